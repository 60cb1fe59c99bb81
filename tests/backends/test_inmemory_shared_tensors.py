"""In-memory ranks are threads, so they can hand a collective the very same tensor (a tensor or
a model the rank function closes over), which separate processes never can. An all_reduce SUM,
AVG or PRODUCT in place into it would count it once per rank (it gave 4x for 3 ranks of SUM, and
x / n for AVG), so it is refused on every rank with an error that says to give each rank its own;
MAX and MIN, which come out right, still run (NumPy oracle, exact)."""
import numpy as np
import pytest
import torch

from distframe import spawn


def _outcomes(fn, world_size):
    def wrapped(b):
        try:
            return fn(b)
        except ValueError as exc:
            return exc
    return spawn(wrapped, world_size, timeout=10)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("op", ["sum", "avg", "product"])
@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce_into_one_tensor_shared_by_ranks_is_refused(world_size, op, async_op):
    before = np.linspace(-1.5, 2.5, 7)
    shared = torch.tensor(before)

    def fn(b):
        work = b.all_reduce(shared, op, async_op=async_op)
        return work.wait() if async_op else work
    errors = _outcomes(fn, world_size)
    for error in errors:
        assert isinstance(error, ValueError), errors
        assert f"ranks {list(range(world_size))} passed tensors that share memory" in str(error)
    np.testing.assert_array_equal(shared.numpy(), before)  # left unchanged


def test_ranks_named_are_those_sharing():
    """Ranks 1 and 3 pass rows 1-2 and 2-3 of one buffer (row 2 in both); 0 and 2 their own."""
    base = torch.arange(8.0).view(4, 2)

    def fn(b):
        return b.all_reduce({1: base[1:3], 3: base[2:4]}.get(b.rank, torch.zeros(2, 2)))
    errors = _outcomes(fn, 4)
    assert all(isinstance(e, ValueError) and "ranks [1, 3] passed" in str(e) for e in errors), errors


@pytest.mark.parametrize("op", ["max", "min"])
def test_max_and_min_of_a_shared_tensor_still_run(op):
    values = np.linspace(-1.5, 2.5, 7)
    shared = torch.tensor(values)
    own = [torch.tensor(values - 1.0), torch.tensor(values + 1.0)]

    def fn(b):
        t = own[b.rank - 2] if b.rank >= 2 else shared
        b.all_reduce(t, op)
        b.barrier()
        return t.clone()
    expected = values + 1.0 if op == "max" else values - 1.0
    for result in spawn(fn, 4, timeout=10):
        np.testing.assert_array_equal(result.numpy(), expected)


def test_separate_tensors_of_one_storage_are_fine():
    """Rows of one buffer, one per rank, do not overlap: a plain sum."""
    buffer = torch.arange(12.0, dtype=torch.float64).view(3, 4)

    def fn(b):
        b.all_reduce(buffer[b.rank])
        b.barrier()
        return buffer[b.rank].clone()
    for result in spawn(fn, 3, timeout=10):
        np.testing.assert_array_equal(result.numpy(), np.arange(12.0).reshape(3, 4).sum(0))
