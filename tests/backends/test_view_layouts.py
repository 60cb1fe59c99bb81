"""Tensors whose memory is not simply their values, on every engine, against a NumPy oracle.

- A float16 tensor with torch's neg bit (the ``.imag`` of a conjugated complex32 tensor): AVG
  averages a float32 copy, and torch's float32-to-float16 ``copy_`` wrote the mean back as if the
  bit were clear, so ``all_reduce``/``reduce`` returned the negated mean (in-memory and MPI).
- A tensor of one element whose stride is not 1 (``t[::2]`` of two elements, which torch calls
  contiguous): Gloo moves int16, complex and the unsigned dtypes as bytes, and ``view(uint8)``
  refused it ("must be 1 to view Short as Byte") in every moving call.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from distframe.launch import spawn
from tests.backends.mpi_pools import mpi_pool_fixture

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
WORLD = 2
BYTE_MOVED = (torch.int16, torch.complex64, torch.uint32)


def _stepped(dtype: torch.dtype, value: int) -> torch.Tensor:
    t = torch.zeros(2, dtype=dtype)
    t[0] = value
    view = t[::2]
    assert view.is_contiguous() and view.stride() == (2,)
    return view


def _negated(rank: int) -> torch.Tensor:
    """float16 values (-(rank + 1), 3 + rank) stored as their negation under the neg bit."""
    view = torch._neg_view(torch.tensor([rank + 1.0, -(3.0 + rank)], dtype=torch.float16))
    assert view.is_neg() and view.is_contiguous()
    return view


def every_case(b) -> dict[str, list]:
    r, peer = b.rank, 1 - b.rank
    found = {}
    imag = torch.tensor([1 + (2 + r) * 1j], dtype=torch.complex64).to(torch.complex32).conj().imag
    found["imag avg"] = b.all_reduce(imag, "AVG").tolist()
    found["neg avg"] = b.all_reduce(_negated(r), "AVG").tolist()
    found["neg sum"] = b.all_reduce(_negated(r), "SUM").tolist()
    reduced = _negated(r)
    b.reduce(reduced, 0, "AVG")
    found["neg reduce avg"] = reduced.tolist()
    for dtype in BYTE_MOVED:
        name = str(dtype).removeprefix("torch.")
        found[f"{name} all_gather"] = b.all_gather(_stepped(dtype, r + 1)).tolist()
        found[f"{name} broadcast"] = b.broadcast(_stepped(dtype, r + 5), 1).tolist()
        gathered = b.gather(_stepped(dtype, r + 1), 0)
        found[f"{name} gather"] = None if gathered is None else [g.tolist() for g in gathered]
        chunks = [_stepped(dtype, 10 + k) for k in range(WORLD)] if r == 0 else None
        found[f"{name} scatter"] = b.scatter(chunks, 0).tolist()
        if r == 0:
            b.send(_stepped(dtype, 9), peer)
        else:
            found[f"{name} recv"] = b.recv(_stepped(dtype, 0), peer).tolist()
    return found


def _check(results: list[dict[str, list]]) -> None:
    values = [np.array([-(r + 1.0), 3.0 + r]) for r in range(WORLD)]
    mean, total = np.mean(values, axis=0).tolist(), np.sum(values, axis=0).tolist()
    imag_mean = float(np.mean([-(2.0 + r) for r in range(WORLD)]))
    for r, found in enumerate(results):
        assert found["imag avg"] == [imag_mean], found["imag avg"]
        assert found["neg avg"] == mean and found["neg sum"] == total, found
        assert found["neg reduce avg"] == (mean if r == 0 else values[r].tolist())
        for dtype in BYTE_MOVED:
            name = str(dtype).removeprefix("torch.")
            want = [complex(k) if dtype.is_complex else k for k in range(1, WORLD + 1)]
            assert found[f"{name} all_gather"] == want
            assert found[f"{name} broadcast"] == [6]
            assert found[f"{name} gather"] == ([[k] for k in want] if r == 0 else None)
            assert found[f"{name} scatter"] == [10 + r]
            if r == 1:
                assert found[f"{name} recv"] == [9]


def test_inmemory():
    _check(spawn(every_case, WORLD, timeout=10))


@pytest.mark.gloo
def test_gloo():
    _check(spawn(every_case, WORLD, "gloo", timeout=20))


pool = mpi_pool_fixture(WORLD, timeout=20)


@pytest.mark.mpi
def test_mpi(pool):
    _check(pool.run(every_case))
