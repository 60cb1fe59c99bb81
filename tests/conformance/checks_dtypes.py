"""Conformance checks of dtypes beyond those of checks.py: what a reduction of float16 or
bfloat16 rounds, and when; scatter of dtypes outside the usual set. Run on every engine by
test_collectives.py, like the checks in checks.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from distframe.backends import ReduceOp
from tests.conformance.oracle import as_numpy, assert_matches, input_device


def check_low_precision_average(backend) -> None:
    """AVG of float16 near its largest value (65504), where the sum of the ranks' values
    overflows float16 and their mean does not. Engines that reduce in float32 (in-memory, MPI)
    give the mean rounded once to float16. Gloo and NCCL move float16 itself (half the bytes):
    their sum of pre-divided values is rounded, and so is the scaling after it, so theirs is
    within 2 units in the last place (2 * 2**-10 relative). all_reduce, reduce_scatter and
    reduce alike, each with a synchronous and an asynchronous call."""
    n, r, device = backend.world_size, backend.rank, input_device()
    values = [65504.0 - 32 * k for k in range(n)]  # each exactly a float16
    mean = float(np.mean(values))

    def check(got: torch.Tensor, expected: np.ndarray, what: str) -> None:
        if backend.engine not in ("gloo", "nccl"):
            assert_matches(got, expected, "float16", what)  # rounds the oracle to float16 once
            return
        assert got.dtype == torch.float16, f"{what}: dtype {got.dtype}"
        np.testing.assert_allclose(as_numpy(got).astype(np.float64), expected, rtol=2 * 2.0 ** -10,
                                   atol=0, err_msg=what)

    for async_op in (False, True):
        mine = torch.full((4,), values[r], dtype=torch.float16, device=device)
        work = backend.all_reduce(mine, ReduceOp.AVG, async_op=async_op)
        if async_op:
            work.wait()
        check(mine, np.full(4, mean), f"all_reduce AVG async_op={async_op}")
        rows = torch.full((4 * n,), values[r], dtype=torch.float16, device=device)
        work = backend.reduce_scatter(rows, ReduceOp.AVG, async_op=async_op)
        check(work.wait() if async_op else work, np.full(4, mean), f"reduce_scatter AVG async_op={async_op}")
        chunk = torch.empty(4, dtype=torch.float16, device=device)
        backend.reduce_scatter(rows, ReduceOp.AVG, out=chunk)
        check(chunk, np.full(4, mean), "reduce_scatter AVG into out")
        mine = torch.full((2, 4), values[r], dtype=torch.float16, device=device).t()
        work = backend.reduce(mine, n - 1, ReduceOp.AVG, async_op=async_op)
        if async_op:
            work.wait()
        check(mine, np.full((4, 2), mean if r == n - 1 else values[r]),
              f"reduce AVG of a transposed view, async_op={async_op}")


def check_scatter_of_rarer_dtypes(backend) -> None:
    """scatter, whose source alone knows the chunks' dtype, sends any dtype the engine moves
    (uint16, float8) and, for one it has no name for (bit-packed bits8) or more dims than its
    header holds, raises on every rank instead of leaving the others waiting for the source."""
    n, r, device = backend.world_size, backend.rank, input_device()
    for dtype in (torch.uint16, torch.uint64, torch.float8_e5m2):
        chunks = [torch.full((2, 3), float(k + 1), device=device).to(dtype) for k in range(n)]
        got = backend.scatter(chunks if r == 0 else None, 0)
        if got.dtype != dtype or got.to(torch.float32).ne(r + 1).any():
            raise AssertionError(f"scatter of {dtype} gave {got.dtype} {got.to(torch.float32).tolist()}")
    packed = [torch.full((2,), k, dtype=torch.uint8, device=device).view(torch.bits8) for k in range(n)]
    try:  # the in-memory engine moves it; the others must say they cannot, on every rank
        got = backend.scatter(packed if r == n - 1 else None, n - 1)
    except ValueError as exc:
        if backend.engine == "inmemory" or "scatter" not in str(exc):
            raise
    else:
        if backend.engine != "inmemory" or got.view(torch.uint8).tolist() != [r, r]:
            raise AssertionError(f"{backend.engine}: scatter of bits8 gave {got.view(torch.uint8)}")
    deep = [torch.full((1,) * 40, float(k), device=device) for k in range(n)]  # more dims than
    try:  # Gloo's (16) or MPI's (32) header has room for: the same rule as for dtypes
        got = backend.scatter(deep if r == 0 else None, 0)
    except ValueError as exc:
        if backend.engine == "inmemory" or "dims" not in str(exc):
            raise
    else:
        if backend.engine != "inmemory" or got.flatten().tolist() != [float(r)]:
            raise AssertionError(f"{backend.engine}: scatter of 40-dim chunks gave {got.shape}")
    backend.barrier()


RARER = ("float8_e4m3fn", "float8_e5m2", "complex32", "uint16", "uint32", "uint64")


def check_rarer_dtypes_move_alike(backend) -> None:
    """float8, complex32 and wide unsigned integers move on every engine (all_gather, broadcast,
    all_to_all, send/recv bytes exactly: the MPI engine could move none of float8 and complex32);
    a reduction of a dtype torch has no arithmetic for (float8, uint16-64) is a ValueError on
    every engine, where MPI summed uint16 and the others raised torch's NotImplementedError;
    complex32 reduces on every engine (MPI in complex64, rounded once)."""
    n, r, device = backend.world_size, backend.rank, input_device()
    for name in RARER:
        dtype = getattr(torch, name)
        mine = (torch.arange(6, device=device, dtype=torch.float32) + 8 * r).to(dtype).reshape(3, 2)
        bits = torch.int32 if dtype == torch.complex32 else None

        def raw(t: torch.Tensor) -> list:
            return (t.view(bits) if bits else t.view(torch.uint8) if t.element_size() == 1 else t.to(
                torch.float64)).tolist()
        expected = [raw((torch.arange(6, device=device, dtype=torch.float32) + 8 * k).to(dtype).reshape(3, 2))
                    for k in range(n)]
        gathered = backend.all_gather(mine)
        assert gathered.dtype == dtype and [raw(c) for c in gathered.chunk(n)] == expected, name
        sent = mine.clone()
        backend.broadcast(sent, n - 1)
        assert raw(sent) == expected[n - 1], f"broadcast of {name}"
        if dtype == torch.complex32:
            total = mine.clone()
            backend.all_reduce(total)
            want = sum(torch.arange(6, dtype=torch.float32) + 8 * k for k in range(n)).reshape(3, 2)
            assert total.dtype == dtype and total.to(torch.complex64).real.cpu().tolist() == want.tolist()
            continue
        for call in (lambda: backend.all_reduce(mine.clone()), lambda: backend.reduce(mine.clone(), 0),
                     lambda: backend.reduce_scatter(torch.zeros(2 * n, dtype=dtype, device=device))):
            try:
                call()
            except ValueError as exc:
                assert "no arithmetic" in str(exc) and name in str(exc), str(exc)
            else:
                raise AssertionError(f"{backend.engine}: a reduction of {name} did not raise")
    backend.barrier()  # every rank raised before communicating: they are still in step


def check_complex_min_max_is_refused_alike(backend) -> None:
    """MIN and MAX of complex tensors, which have no order, are a ValueError naming the op on
    every rank of every engine, before anything moves (all_reduce, reduce, reduce_scatter,
    synchronous or not), so the group stays in step. MPI raised its raw "Invalid MPI_Op" error
    stack, Gloo torch's RuntimeError after a wasted all-gather, the in-memory engine torch's."""
    n, r, device = backend.world_size, backend.rank, input_device()
    for dtype in (torch.complex64, torch.complex128):
        mine = torch.full((2 * n,), complex(r, 1), dtype=dtype, device=device)
        for op in (ReduceOp.MIN, ReduceOp.MAX):
            calls = (("all_reduce", lambda: backend.all_reduce(mine.clone(), op)),
                     ("async all_reduce", lambda: backend.all_reduce(mine.clone(), op, async_op=True)),
                     ("reduce", lambda: backend.reduce(mine.clone(), n - 1, op)),
                     ("reduce_scatter", lambda: backend.reduce_scatter(mine, op)))
            for what, call in calls:
                try:
                    call()
                except ValueError as exc:
                    if op.name not in str(exc) or "complex" not in str(exc):
                        raise AssertionError(f"{what} {op.name} of {dtype}: {exc}") from exc
                else:
                    raise AssertionError(f"{backend.engine}: {what} {op.name} of {dtype} did not raise")
    total = backend.all_reduce(torch.tensor([float(r)], device=device))
    np.testing.assert_array_equal(as_numpy(total), [np.arange(n).sum()])


def check_complex32_average(backend) -> None:
    """AVG of complex32, which torch cannot divide: every engine averages a complex64 copy and
    rounds once (all_reduce, reduce_scatter, reduce). It raised torch's NotImplementedError
    ("div_cpu" not implemented for 'ComplexHalf') on every engine, after the data had moved."""
    n, r, device = backend.world_size, backend.rank, input_device()

    def values(k: int, size: int) -> torch.Tensor:  # small integers: every mean is exact
        parts = torch.arange(2 * size, dtype=torch.float32).reshape(size, 2) + 4 * k
        return torch.view_as_complex(parts).to(device)
    mean = sum(values(k, 2 * n) for k in range(n)).cpu().numpy() / n
    mine = values(r, 2 * n).to(torch.complex32)
    reduced = mine.clone()
    backend.all_reduce(reduced, ReduceOp.AVG)
    chunk = backend.reduce_scatter(mine, ReduceOp.AVG)
    at_root = mine.clone()
    backend.reduce(at_root, n - 1, ReduceOp.AVG)
    kept = values(r, 2 * n).cpu().numpy()  # what a rank other than the root keeps
    for what, got, expected in (("all_reduce", reduced, mean),
                                ("reduce_scatter", chunk, mean[2 * r:2 * r + 2]),
                                ("reduce", at_root, mean if r == n - 1 else kept)):
        if got.dtype != torch.complex32:
            raise AssertionError(f"{what} AVG of complex32 gave {got.dtype}")
        np.testing.assert_array_equal(got.to(torch.complex64).cpu().numpy(), expected, err_msg=what)


def _lazy_views(r: int):
    """Rank r's lazily negated view (torch's neg bit: the .imag of a conjugate) and lazily
    conjugated view (conj bit), each of 2 elements, with the values they stand for."""
    base = torch.tensor([1 + 5j, 2 - 3j], dtype=torch.complex128) * (r + 1)
    neg = base.conj().imag  # values -5(r+1), 3(r+1); memory holds their negation
    conj = base.conj()
    assert neg.is_neg() and conj.is_conj()
    return [(neg, neg.resolve_neg().clone()), (conj, conj.resolve_conj().clone())]


def check_lazy_views_move_their_values(backend) -> None:
    """Gloo and MPI read memory, where these views hold the negated or conjugated values: they
    sent 5 for -5 and failed in NumPy; the in-memory engine, which uses torch ops, was right."""
    n, r = backend.world_size, backend.rank
    for k in range(2):
        views = [_lazy_views(q)[k] for q in range(n)]
        mine, value = _lazy_views(r)[k]
        everyone = torch.stack([v for _, v in views])
        assert torch.equal(backend.all_gather(mine), everyone.reshape(-1)), "all_gather"
        if k == 0:  # real: every reduce op
            for op, expect in (("sum", everyone.sum(0)), ("max", everyone.amax(0))):
                target, _ = _lazy_views(r)[k]
                backend.all_reduce(target, op)
                assert torch.equal(target.resolve_neg(), expect), f"all_reduce {op}"
        else:
            target, _ = _lazy_views(r)[k]
            backend.all_reduce(target)
            assert torch.equal(target.resolve_conj(), everyone.sum(0)), "all_reduce of a conj view"
        target, _ = _lazy_views(r)[k]
        backend.broadcast(target, 0)
        assert torch.equal(target.resolve_conj().resolve_neg(), views[0][1]), "broadcast"
        gathered = backend.gather(mine, 0)
        if r == 0:
            assert torch.equal(torch.stack(gathered), everyone), "gather"
        got = backend.scatter([v for v, _ in views] if r == 0 else None, 0)
        assert torch.equal(got, value), "scatter"
        parts = backend.all_to_all([mine[:1]] * n)
        assert torch.equal(torch.cat(parts), everyone[:, 0]), "all_to_all"
        if n > 1:
            into, _ = _lazy_views(r)[k]
            if r == 0:
                backend.send(views[0][0], 1)
            elif r == 1:
                backend.recv(into, 0)
                assert torch.equal(into.resolve_conj().resolve_neg(), views[0][1]), "recv into a view"
        backend.barrier()


def check_zero_dim_all_to_all_chunks_are_named(backend) -> None:
    n = backend.world_size
    with pytest.raises(ValueError, match=r"chunk 0 is 0-dim.*reshape\(1\)"):
        backend.all_to_all([torch.tensor(1.0)] * n)
    backend.barrier()
