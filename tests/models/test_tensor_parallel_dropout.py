"""Dropout under tensor parallelism (Megatron's RNG tracker): the ranks of a tensor group draw the
same masks for replicated activations, so replicated parameters stay bitwise equal across them;
data-parallel replicas and the head-split attention probabilities draw their own; a seed makes
the run reproducible, on threads and on processes alike; other dropout modules (channel, alpha)
are refused."""
from __future__ import annotations

import pytest
import torch

from distframe.errors import ConfigError
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



def _mlp_with(dropout):
    from tests.models.common import SEED_LOCK
    with SEED_LOCK:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4),
                                   dropout, torch.nn.Linear(4, 2)).double()


class _OwnDropout(torch.nn.Dropout):
    def forward(self, x):
        return torch.nn.functional.dropout(x, self.p, self.training) * 1.0


@pytest.mark.parametrize("make", [lambda: torch.nn.Dropout1d(0.5), lambda: torch.nn.AlphaDropout(0.5),
                                  lambda: torch.nn.FeatureAlphaDropout(0.5), lambda: _OwnDropout(0.5)],
                         ids=["Dropout1d", "AlphaDropout", "FeatureAlphaDropout", "subclass"])
@pytest.mark.parametrize("pp", [1, 2])
def test_dropout_that_cannot_draw_alike_across_the_tensor_group_is_refused(make, pp):
    # These drew from torch's global generator, differently on each tensor rank: the replicated
    # parameters (here the last Linear) silently trained apart. Only nn.Dropout is replaced.
    # Every rank refuses, the stage without the dropout too (pp=2 puts it on stage 1).
    def run(b):
        try:
            HybridShardedModel(_mlp_with(make()), b, dims=ParallelDims(tp=2, pp=pp),
                               tp_plan={"0": "column", "2": "row"}, split_points=[3] if pp > 1 else None)
        except ConfigError as error:
            return str(error)

    for message in spawn(run, 2 * pp):
        assert message is not None and "'3' is a" in message and "use nn.Dropout or p=0" in message


@pytest.mark.parametrize("make", [lambda: torch.nn.Dropout1d(0.0), lambda: torch.nn.Dropout(0.5)])
def test_dropout_that_draws_alike_or_not_at_all_keeps_replicated_parameters_equal(make):
    def run(b):
        model = TensorParallelModel(_mlp_with(make()), b, plan={"0": "column", "2": "row"}, dropout_seed=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            x = torch.randn(6, 3, 4, generator=g, dtype=torch.float64)
            y = torch.zeros(6, 3, 2, dtype=torch.float64)
            model.train_step((x, y), torch.nn.functional.mse_loss, opt)
        return {lp.name: lp.param.detach() for lp in model.local_parameters if lp.split_dim is None}

    first, second = spawn(run, 2)
    assert first.keys() == {"2.bias", "4.weight", "4.bias"}
    assert all(torch.equal(first[name], second[name]) for name in first)


# ---- the generators in checkpoints ----------------------------------------------------------------
def _build(backend, dims, seed):
    if dims.dp == dims.pp == 1:
        return TensorParallelModel(tiny_lm(dropout=DROPOUT), backend, dropout_seed=seed)
    return HybridShardedModel(tiny_lm(dropout=DROPOUT), backend, dims=dims, num_microbatches=2,
                              dropout_seed=seed)


def _run(backend, dims, seed, steps, load_from=None, save_to=None, **load_settings):
    """Adam steps ``steps`` (indices into ``batches()``), after loading ``load_from`` and before
    saving ``save_to``; this rank's losses and the gathered dense parameters."""
    from distframe import checkpoint
    model = _build(backend, dims, seed)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    if load_from is not None:
        checkpoint.load(load_from, model, opt, **load_settings)
    per = BATCH // dims.dp
    lo = model.groups.dp_index * per
    losses = [model.train_step((x[lo:lo + per], y[lo:lo + per]), lm_loss, opt)
              for x, y in (batches()[s] for s in steps)]
    if save_to is not None:
        checkpoint.save(save_to, model, opt, step=steps[-1] + 1 if steps else None)
    return losses, model.gather_full_parameters()


def _save_after_one_step(path, dims):
    spawn(lambda b: _run(b, dims, 7, [0], save_to=path), dims.world_size)


@pytest.mark.parametrize("dp,tp,pp", [(1, 2, 1), (2, 2, 1), (1, 2, 2)])
def test_a_resumed_run_draws_the_masks_the_uninterrupted_run_draws(tmp_path, dp, tp, pp):
    # The generators were not saved: the resumed run started them again from the seed (here
    # another one, as a restarted job whose seed comes from torch.initial_seed() may have).
    # Bitwise: the same float64 operations in the same order on the same values.
    dims = ParallelDims(dp=dp, tp=tp, pp=pp)
    whole = spawn(lambda b: _run(b, dims, 7, [0, 1, 2]), dims.world_size)
    _save_after_one_step(tmp_path / "ckpt", dims)
    resumed = spawn(lambda b: _run(b, dims, 99, [1, 2], load_from=tmp_path / "ckpt"), dims.world_size)
    for (losses, full), (resumed_losses, resumed_full) in zip(whole, resumed):
        assert resumed_losses == losses[1:]
        for name, tensor in full.items():
            assert torch.equal(resumed_full[name], tensor), name


def test_a_checkpoint_saved_right_after_a_load_keeps_the_loaded_generators(tmp_path):
    # Saved before any step drew from them, the loaded states were not saved again, and the
    # run resumed from the second checkpoint restarted its generators from the seed.
    dims = ParallelDims(tp=2)
    whole = spawn(lambda b: _run(b, dims, 7, [0, 1, 2]), 2)
    _save_after_one_step(tmp_path / "first", dims)
    spawn(lambda b: _run(b, dims, 99, [], load_from=tmp_path / "first", save_to=tmp_path / "again"), 2)
    resumed = spawn(lambda b: _run(b, dims, 98, [1, 2], load_from=tmp_path / "again"), 2)
    for (losses, _), (resumed_losses, _) in zip(whole, resumed):
        assert resumed_losses == losses[1:]


def _strip_dropout_rng(path):
    """Makes ``path`` a checkpoint as distframe wrote it before it saved the generators."""
    import json
    meta_path = path / "metadata.json"
    meta = json.loads(meta_path.read_text())
    assert meta.pop("dropout_rng") is not None
    for table in meta["files"]:
        table["tensors"] = {k: n for k, n in table["tensors"].items() if not k.startswith("dropout_rng/")}
    del meta["metadata_sha256"]  # and before metadata checksums (format version 1)
    meta["format_version"] = 1
    meta_path.write_text(json.dumps(meta))


def test_a_checkpoint_without_the_generators_loads_with_fresh_ones(tmp_path):
    dims = ParallelDims(tp=2)
    _save_after_one_step(tmp_path / "ckpt", dims)
    _strip_dropout_rng(tmp_path / "ckpt")
    old = spawn(lambda b: _run(b, dims, 7, [1, 2], load_from=tmp_path / "ckpt"), 2)
    # What loading did before the generators were saved: the model's own, from its seed.
    fresh = spawn(lambda b: _run(b, dims, 7, [1, 2], load_from=tmp_path / "ckpt",
                                 restore_dropout_rng=False), 2)
    assert_same_run([(None, None, *r) for r in old], [(None, None, *r) for r in fresh])
    whole = spawn(lambda b: _run(b, dims, 7, [0, 1, 2]), 2)
    assert old[0][0] != whole[0][0][1:]  # fresh generators: the first step's masks again


def test_generators_saved_under_another_layout_are_refused_by_name(tmp_path):
    from distframe.checkpoint import CheckpointError
    _save_after_one_step(tmp_path / "ckpt", ParallelDims(tp=2))
    other = ParallelDims(tp=4)

    def load(backend, **settings):
        try:
            _run(backend, other, 7, [1], load_from=tmp_path / "ckpt", **settings)
        except CheckpointError as exc:
            return str(exc)
        return None
    for message in spawn(load, 4):
        assert message is not None and "dp=1 tp=2 pp=1 cp=1" in message and "dp=1 tp=4 pp=1 cp=1" in message
        assert "restore_dropout_rng=False" in message
    assert spawn(lambda b: load(b, restore_dropout_rng=False), 4) == [None] * 4


def test_head_shard_drops_the_pairs_the_full_module_drops():
    """Pair decisions hash the global head index: a rank holding heads [2, 4) of 4, given the
    generator state the full module had, drops what the full module drops for those heads."""
    from attention import DilatedAttention
    from distframe.models.tensor_parallel_attention import HeadShardedDilatedAttention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, 4, 4, dtype=torch.float64, generator=g) for _ in range(3))
    dense = DilatedAttention([4, 8], [1, 2], attention_dropout=0.4).train()
    shard = HeadShardedDilatedAttention(dense, head_start=2, total_heads=4).train()
    torch.manual_seed(3)
    full = dense(q, k, v, is_causal=True)
    torch.manual_seed(3)
    part = shard(q[:, :, 2:], k[:, :, 2:], v[:, :, 2:], is_causal=True)
    assert (part - full[:, :, 2:]).abs().max().item() < 1e-12
    dense.eval()
    assert (full - dense(q, k, v, is_causal=True)).abs().max().item() > 1e-3  # dropout acted
