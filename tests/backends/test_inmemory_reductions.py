"""The in-memory all_reduce's and reduce_scatter's two ways of reducing: split by rank (each rank
reduces one element range, or its own chunk, of every input) and, for a tensor of at most
``WHOLE_REDUCE_BYTES``, whole (one rank reduces everything, each copies its part). Both fold the
inputs in rank order, so they give the same bits, on every rank, as a NumPy left fold in rank
order (float64: exact)."""
import numpy as np
import pytest
import torch

from distframe import spawn
from distframe.backends import inmemory

OPS = {"sum": np.add, "product": np.multiply, "max": np.maximum, "min": np.minimum}


def _inputs(rank, numel, dtype):
    g = torch.Generator().manual_seed(1000 + rank)
    return (torch.rand(numel, generator=g, dtype=torch.float64) * 2 - 0.5).to(dtype)


def _reduce(call, world, numel, dtype, op, whole, monkeypatch):
    """Each rank's result of ``call``; a reduce_scatter's joined in rank order."""
    monkeypatch.setattr(inmemory, "WHOLE_REDUCE_BYTES", 1 << 40 if whole else 0)

    def fn(b):
        return getattr(b, call)(_inputs(b.rank, numel, dtype), op)
    results = spawn(fn, world)
    return results if call == "all_reduce" else [torch.cat(results)]


@pytest.mark.parametrize("call", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("op", ["sum", "product", "max", "min", "avg"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_whole_and_split_give_the_same_bits_on_every_rank(call, world, op, dtype, monkeypatch):
    # all_reduce: 1001 elements, not a multiple of any world (the last rank's range is shorter);
    # reduce_scatter: a multiple of the world, as it needs.
    numel = 1001 if call == "all_reduce" else 84 * world
    whole = _reduce(call, world, numel, dtype, op, True, monkeypatch)
    split = _reduce(call, world, numel, dtype, op, False, monkeypatch)
    for got in whole + split:
        assert torch.equal(got, whole[0]), (op, dtype)
    if dtype == torch.float64 and op != "avg":  # the oracle: a left fold in rank order
        expected = _inputs(0, numel, dtype).numpy()
        for r in range(1, world):
            expected = OPS[op](expected, _inputs(r, numel, dtype).numpy())
        np.testing.assert_array_equal(whole[0].numpy(), expected)


def test_tensors_at_the_threshold_and_one_element_over_it_reduce_exactly():
    # With the default threshold: a tensor of WHOLE_REDUCE_BYTES is reduced whole, one element
    # more is split; both agree with the NumPy fold.
    limit = inmemory.WHOLE_REDUCE_BYTES // 8
    for numel in (limit, limit + 1):
        results = spawn(lambda b, n=numel: b.all_reduce(_inputs(b.rank, n, torch.float64)), 3)
        expected = sum(_inputs(r, numel, torch.float64).numpy() for r in range(3))
        for got in results:
            np.testing.assert_array_equal(got.numpy(), expected)
