"""Ranks of one tensor-parallel group given different slices of the batch (the DDP habit of slicing
the global batch by rank), where every rank of a tensor group passes the same one: the step trained
silently on neither slice and train_step returned a different "global" loss on each rank (1.2168
and 1.1829). train_step compares its loss across each tensor group (the ranks compute it bitwise
alike from the same batch: every engine's all_reduce leaves the same bits on every rank) and raises
a ConfigError on every rank of the world, naming the fix."""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models.hybrid import HybridShardedModel
from distframe.models.tensor_parallel_model import TensorParallelModel
from tests.models.common import SEED_LOCK, global_batches, lm_loss, tiny_lm

MLP_PLAN = {"0": "column", "2": "row"}


def _mlp():
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _outcome(model, batch, loss_fn):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        return model.train_step(batch, loss_fn, opt)
    except ConfigError as exc:
        return f"ConfigError: {exc}"


def _by_rank(x, y, index, count):
    per = x.shape[0] // count
    return x[index * per:(index + 1) * per], y[index * per:(index + 1) * per]


def _tensor_parallel(backend, slicing):
    x, y = global_batches(1, 8)[0]
    model = TensorParallelModel(_mlp(), backend, plan=MLP_PLAN)
    batch = _by_rank(x, y, backend.rank, backend.world_size) if slicing == "own" else (x, y)
    return _outcome(model, batch, F.mse_loss)


def test_tensor_parallel_ranks_given_their_own_slices_are_refused_on_every_rank():
    results = spawn(functools.partial(_tensor_parallel, slicing="own"), 2, timeout=60)
    assert all(isinstance(r, str) for r in results), results
    assert results[0] == results[1]
    assert "tensor-parallel group" in results[0] and "data_parallel_coordinates" in results[0]


def test_tensor_parallel_ranks_given_one_batch_train():
    losses = spawn(functools.partial(_tensor_parallel, slicing="same"), 2, timeout=60)
    x, y = global_batches(1, 8)[0]
    with torch.no_grad():
        expected = float(F.mse_loss(_mlp()(x), y))
    assert losses[0] == losses[1] == pytest.approx(expected, rel=1e-12)


def test_tensor_parallel_on_gloo_is_refused_on_every_rank():
    results = spawn(functools.partial(_tensor_parallel, slicing="own"), 2, backend="gloo", timeout=60)
    assert all(isinstance(r, str) and "tensor-parallel group" in r for r in results), results


def _hybrid(backend, dims, slicing):
    g = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, 256, (16, 16), generator=g), torch.randint(0, 256, (16, 16), generator=g)
    model = HybridShardedModel(tiny_lm(), backend, dims=dims, num_microbatches=2)
    dp, dp_index = model.data_parallel_coordinates()
    if slicing == "rank":  # the DDP habit: every rank its own slice
        batch = _by_rank(x, y, backend.rank, backend.world_size)
    elif slicing == "one group" and dp_index == 0:  # one tensor group differs, the others agree
        batch = _by_rank(x, y, model.groups.tp_index, dims.tp * dp)
    else:
        batch = _by_rank(x, y, dp_index, dp)
    return _outcome(model, batch, lm_loss)


@pytest.mark.parametrize("slicing", ["rank", "one group"])
@pytest.mark.parametrize("dp,tp,pp", [(2, 2, 1), (1, 2, 2), (2, 2, 2)])
def test_hybrid_ranks_sliced_by_rank_are_refused_on_every_rank(dp, tp, pp, slicing):
    # Every rank raises, those whose own group agreed too: they would wait for the others' next step.
    dims = ParallelDims(dp=dp, tp=tp, pp=pp)
    results = spawn(functools.partial(_hybrid, dims=dims, slicing=slicing), dims.world_size, timeout=120)
    assert all(isinstance(r, str) and "tensor-parallel group" in r and "data_parallel_coordinates" in r
               for r in results), results


def test_hybrid_ranks_sliced_by_data_parallel_coordinates_train():
    dims = ParallelDims(dp=2, tp=2, pp=1)
    losses = spawn(functools.partial(_hybrid, dims=dims, slicing="coordinates"), dims.world_size, timeout=120)
    assert all(isinstance(loss, float) for loss in losses) and len(set(losses)) == 1, losses


def test_a_nan_loss_on_every_tensor_rank_is_no_mismatch():
    def run(backend):
        x, y = global_batches(1, 8)[0]
        x = x.clone()
        x[0, 0] = float("nan")
        return _outcome(TensorParallelModel(_mlp(), backend, plan=MLP_PLAN), (x, y), F.mse_loss)

    assert all(isinstance(r, float) and math.isnan(r) for r in spawn(run, 2, timeout=60))
