"""Dropout under tensor parallelism (Megatron's RNG tracker): the ranks of a tensor group draw the
same masks for replicated activations, so replicated parameters stay bitwise equal across them;
data-parallel replicas and the head-split attention probabilities draw their own; a seed makes
the run reproducible, on threads and on processes alike."""
from __future__ import annotations

import pytest
import torch

from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models.hybrid import HybridShardedModel
from distframe.models.tensor_parallel_model import TensorParallelModel
from tests.models.common import lm_loss, tiny_lm


DROPOUT, STEPS, BATCH, SEQ, LR = 0.2, 3, 8, 16, 1e-2


def batches():
    g = torch.Generator().manual_seed(5)
    return [tuple(torch.randint(0, 256, (BATCH, SEQ), generator=g) for _ in range(2)) for _ in range(STEPS)]


def train(backend, dims, seed=None):
    """STEPS Adam steps of the tiny LM with dropout; this rank's (dp, pp) coordinates, replicated
    parameters, losses and the gathered dense parameters."""
    settings = {} if seed is None else {"dropout_seed": seed}
    if dims.dp == dims.pp == 1:
        model = TensorParallelModel(tiny_lm(dropout=DROPOUT), backend, **settings)
    else:
        model = HybridShardedModel(tiny_lm(dropout=DROPOUT), backend, dims=dims, num_microbatches=2,
                                   **settings)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    per = BATCH // dims.dp
    lo = model.groups.dp_index * per
    losses = [model.train_step((x[lo:lo + per], y[lo:lo + per]), lm_loss, opt) for x, y in batches()]
    replicated = {lp.name: lp.param.detach().clone() for lp in model.local_parameters if lp.split_dim is None}
    return (model.groups.dp_index, model.groups.pp_index), replicated, losses, model.gather_full_parameters()


def assert_tensor_ranks_agree(results):
    """Bitwise: replicated parameters across each tensor group, the gathered model everywhere."""
    by_coordinates = {}
    for coordinates, replicated, _, _ in results:
        by_coordinates.setdefault(coordinates, []).append(replicated)
    for peers in by_coordinates.values():
        assert len(peers) == 2
        assert peers[0].keys() == peers[1].keys() and peers[0]
        for name, tensor in peers[0].items():
            assert torch.equal(tensor, peers[1][name]), name
    full = results[0][3]
    for _, _, _, other in results[1:]:
        assert other.keys() == full.keys()
        for name, tensor in full.items():
            assert torch.equal(other[name], tensor), name


def assert_same_run(first, second):
    for (_, _, losses_a, full_a), (_, _, losses_b, full_b) in zip(first, second):
        assert losses_a == losses_b
        for name, tensor in full_a.items():
            assert torch.equal(full_b[name], tensor), name


@pytest.mark.parametrize("dp,tp,pp", [(1, 2, 1), (2, 2, 1), (1, 2, 2)])
def test_replicated_parameters_stay_equal_across_tensor_ranks(dp, tp, pp):
    dims = ParallelDims(dp=dp, tp=tp, pp=pp)
    assert_tensor_ranks_agree(spawn(lambda b: train(b, dims), dims.world_size))


def test_a_seed_reproduces_the_run_and_another_seed_changes_it():
    dims = ParallelDims(dp=2, tp=2)
    first = spawn(lambda b: train(b, dims, seed=7), 4)
    assert_same_run(first, spawn(lambda b: train(b, dims, seed=7), 4))
    other = spawn(lambda b: train(b, dims, seed=8), 4)
    assert first[0][2] != other[0][2]  # the masks, hence the losses, follow the seed
    # Without a seed: rank 0's torch.initial_seed() (tiny_lm seeds torch with 0), so runs repeat too.
    assert_same_run(spawn(lambda b: train(b, dims), 4), spawn(lambda b: train(b, dims), 4))


def test_masks_shared_in_the_tensor_group_and_independent_elsewhere():
    dims = ParallelDims(dp=2, tp=2)

    def run(b):
        model = HybridShardedModel(tiny_lm(dropout=0.5), b, dims=dims, dropout_seed=3)
        block = model.wrapped_model.blocks[0]
        ones = torch.ones(2, SEQ, 16, dtype=torch.float64)
        split_generator = model.dropout_rng.split_generator(ones.device)
        assert block.attn.attention.dropout_generator(ones.device) is split_generator
        split = torch.rand(64, generator=split_generator)
        coordinates = (model.groups.dp_index, model.groups.tp_index)
        return coordinates, block.dropout(ones), block.mlp.dropout(ones), split

    out = {coordinates: rest for coordinates, *rest in spawn(run, 4)}
    for dp in (0, 1):
        residual, mlp, split = out[(dp, 0)]
        assert torch.equal(residual, out[(dp, 1)][0]) and torch.equal(mlp, out[(dp, 1)][1])
        assert not torch.equal(residual, mlp)  # a fresh mask per dropout call
        assert not torch.equal(split, out[(dp, 1)][2])  # the heads' probabilities: per tensor rank
        assert set(residual.unique().tolist()) == {0.0, 2.0}
    assert not torch.equal(out[(0, 0)][0], out[(1, 0)][0])  # data-parallel replicas differ


def test_eval_mode_draws_nothing():
    def run(b):
        model = TensorParallelModel(tiny_lm(dropout=0.5), b, dropout_seed=1)
        generators = [model.dropout_rng.replicated_generator(torch.device("cpu")),
                      model.dropout_rng.split_generator(torch.device("cpu"))]
        states = [g.get_state() for g in generators]
        x = torch.randint(0, 256, (2, SEQ))
        model.eval()
        first = model(x)
        unchanged = all(torch.equal(g.get_state(), s) for g, s in zip(generators, states))
        return torch.equal(first, model(x)) and unchanged

    assert spawn(run, 2) == [True, True]


def _train_tensor_parallel(backend):
    return train(backend, ParallelDims(tp=2), seed=11)


@pytest.mark.gloo
def test_processes_draw_the_masks_threads_draw():
    processes = spawn(_train_tensor_parallel, 2, backend="gloo", timeout=60)
    assert_tensor_ranks_agree(processes)
    assert_same_run(processes, spawn(_train_tensor_parallel, 2))


@pytest.mark.parametrize("inplace", [False, True])
def test_generator_dropout_of_everything_gives_zeros(inplace):
    # As F.dropout(p=1): 1 - p = 0 once divided 0 by 0 (NaN).
    from attention.autograd_path import generator_dropout
    out = generator_dropout(torch.ones(6), 1.0, torch.Generator().manual_seed(0), inplace=inplace)
    assert torch.equal(out, torch.zeros(6))
