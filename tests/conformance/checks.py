"""The conformance checks: each runs on every rank of a group, on any engine, and raises
AssertionError if the engine's result differs from the NumPy oracle. Written once; the test
module runs them on every engine and world size."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from distframe.backends import ReduceOp
from tests.conformance.oracle import (DTYPES, FLOAT_NAMES, as_numpy, assert_matches, input_device,
                                      rank_input, reduce_oracle)


def _inputs(world_size: int, shape, dtype_name: str, seed: int) -> list[torch.Tensor]:
    return [rank_input(r, shape, dtype_name, seed) for r in range(world_size)]


def check_all_reduce(backend, dtype_name: str, op: str, shape, seed: int = 0) -> int:
    n, r = backend.world_size, backend.rank
    inputs = _inputs(n, shape, dtype_name, seed)
    mine = inputs[r].clone()
    integer = not (DTYPES[dtype_name].is_floating_point)
    if op == "AVG" and integer:
        with pytest.raises(ValueError, match="AVG"):
            backend.all_reduce(mine, op)
        return 0
    out = backend.all_reduce(mine, getattr(ReduceOp, op))
    if out is not mine:
        raise AssertionError("all_reduce must work in place and return its argument")
    assert_matches(mine, reduce_oracle([as_numpy(t) for t in inputs], op, dtype_name), dtype_name,
                   f"all_reduce {op} {dtype_name} {shape} on rank {r}")
    return mine.numel()


def check_all_reduce_non_contiguous(backend, dtype_name: str = "float32") -> None:
    n, r = backend.world_size, backend.rank
    base = [rank_input(k, (6, 4), dtype_name, seed=3) for k in range(n)]
    mine = base[r].clone().t()  # (4, 6) view, not contiguous
    backend.all_reduce(mine)
    expected = reduce_oracle([as_numpy(b) for b in base], "SUM", dtype_name).T
    assert_matches(mine, expected, dtype_name, "all_reduce into a transposed view")


def check_all_gather(backend, dtype_name: str, shape, seed: int = 0) -> None:
    n, r = backend.world_size, backend.rank
    inputs = _inputs(n, shape, dtype_name, seed)
    out = backend.all_gather(inputs[r].clone())
    parts = [as_numpy(t).reshape(1) if t.dim() == 0 else as_numpy(t) for t in inputs]
    assert_matches(out, np.concatenate(parts), dtype_name, f"all_gather {dtype_name} {shape}")


def check_reduce_scatter(backend, dtype_name: str, op: str, rows_per_rank: int, seed: int = 0) -> None:
    n, r = backend.world_size, backend.rank
    shape = (rows_per_rank * n, 3)
    inputs = _inputs(n, shape, dtype_name, seed)
    out = backend.reduce_scatter(inputs[r].clone(), getattr(ReduceOp, op))
    full = reduce_oracle([as_numpy(t) for t in inputs], op, dtype_name)
    assert_matches(out, full[r * rows_per_rank:(r + 1) * rows_per_rank], dtype_name,
                   f"reduce_scatter {op} {dtype_name}")
    if n > 1:
        with pytest.raises(ValueError, match="divisible"):
            backend.reduce_scatter(torch.zeros(n + 1, 2, dtype=DTYPES[dtype_name]))


def check_broadcast(backend, dtype_name: str, src: int, shape=(5, 2)) -> None:
    n, r = backend.world_size, backend.rank
    src = src % n
    inputs = _inputs(n, shape, dtype_name, seed=11)
    mine = inputs[r].clone()
    backend.broadcast(mine, src)
    assert_matches(mine, as_numpy(inputs[src]), dtype_name, f"broadcast from {src}")


def check_reduce(backend, dtype_name: str, op: str, dst: int) -> None:
    n, r = backend.world_size, backend.rank
    dst = dst % n
    inputs = _inputs(n, (7,), dtype_name, seed=5)
    mine = inputs[r].clone()
    backend.reduce(mine, dst, getattr(ReduceOp, op))
    expected = (reduce_oracle([as_numpy(t) for t in inputs], op, dtype_name) if r == dst
                else as_numpy(inputs[r]))
    assert_matches(mine, expected, dtype_name, f"reduce {op} to {dst} on rank {r}")


def check_gather_scatter(backend, dtype_name: str, root: int) -> None:
    n, r = backend.world_size, backend.rank
    root = root % n
    inputs = _inputs(n, (2, 3), dtype_name, seed=7)
    gathered = backend.gather(inputs[r].clone(), root)
    if r == root:
        if len(gathered) != n:
            raise AssertionError(f"gather returned {len(gathered)} tensors for {n} ranks")
        for k in range(n):
            assert_matches(gathered[k], as_numpy(inputs[k]), dtype_name, f"gather slot {k}")
    elif gathered is not None:
        raise AssertionError("gather must return None off the destination rank")
    chunks = [rank_input(100 + k, (3,), dtype_name, seed=8) for k in range(n)]
    got = backend.scatter(chunks if r == root else None, root)
    assert_matches(got, as_numpy(chunks[r]), dtype_name, f"scatter from {root}")


def check_all_to_all(backend, dtype_name: str) -> None:
    n, r = backend.world_size, backend.rank
    # Rank i sends (i + j + 1) rows to rank j: uneven on purpose.
    def chunk(i: int, j: int) -> torch.Tensor:
        return rank_input(10 * i + j, (i + j + 1, 2), dtype_name, seed=9)
    out = backend.all_to_all([chunk(r, j) for j in range(n)])
    for j in range(n):
        assert_matches(out[j], as_numpy(chunk(j, r)), dtype_name, f"all_to_all from {j} to {r}")


def check_point_to_point(backend, dtype_name: str = "float32") -> None:
    n, r = backend.world_size, backend.rank
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    outgoing = rank_input(r, (4, 2), dtype_name, seed=13)
    incoming = torch.empty_like(outgoing)
    recv = backend.irecv(incoming, left, tag=3)
    send = backend.isend(outgoing, right, tag=3)
    send.wait()
    recv.wait()
    assert_matches(incoming, as_numpy(rank_input(left, (4, 2), dtype_name, seed=13)), dtype_name, "ring isend/irecv")
    # Blocking send/recv between rank 0 and 1, with two tags in flight at once.
    if r == 0:
        backend.send(torch.full((3,), 1.0), 1, tag=1)
        backend.send(torch.full((3,), 2.0), 1, tag=2)
    elif r == 1:
        second, first = torch.zeros(3), torch.zeros(3)
        backend.recv(second, 0, tag=2)
        backend.recv(first, 0, tag=1)
        if first.tolist() != [1.0] * 3 or second.tolist() != [2.0] * 3:
            raise AssertionError(f"tagged recv mixed messages: {first}, {second}")
    # Receives on one channel match messages in the order they were posted (MPI's non-overtaking
    # rule), whichever is waited for first.
    if r == 0:
        backend.send(torch.full((2,), 1.0), 1, tag=4)
        backend.send(torch.full((2,), 2.0), 1, tag=4)
    elif r == 1:
        first, second = torch.zeros(2), torch.zeros(2)
        works = [backend.irecv(first, 0, tag=4), backend.irecv(second, 0, tag=4)]
        works[1].wait()
        works[0].wait()
        if first.tolist() != [1.0] * 2 or second.tolist() != [2.0] * 2:
            raise AssertionError(f"irecvs waited for out of order got {first}, {second}")
    backend.barrier()


def check_async_ops(backend) -> None:
    n, r = backend.world_size, backend.rank
    tensors = [torch.full((1000,), float(r + k)) for k in range(4)]
    works = [backend.all_reduce(t, async_op=True) for t in tensors]
    gathered = backend.all_gather(torch.tensor([float(r)]), async_op=True)
    for k, (w, t) in enumerate(zip(works, tensors)):
        if w.wait() is not t:
            raise AssertionError("all_reduce Work.wait() must return the reduced tensor")
        expected = sum(range(n)) + n * k
        if not torch.all(t == expected):
            raise AssertionError(f"async all_reduce {k}: got {t[0].item()}, expected {expected}")
    if gathered.wait().tolist() != [float(k) for k in range(n)]:
        raise AssertionError("async all_gather result is wrong")
    backend.barrier(async_op=True).wait()


def check_subgroups(backend) -> None:
    n, r = backend.world_size, backend.rank
    order = list(reversed(range(n)))
    group = backend.new_group(order)  # every rank, renumbered in reverse
    if group.rank != n - 1 - r or group.world_size != n:
        raise AssertionError(f"new_group renumbering: rank {r} became {group.rank}")
    if group.all_gather(torch.tensor([r])).tolist() != order:
        raise AssertionError("subgroup all_gather must follow the subgroup's rank order")
    evens = list(range(0, n, 2))
    sub = backend.new_group(evens)
    if (sub is None) == (r in evens):
        raise AssertionError(f"rank {r}: membership of new_group({evens}) is wrong")
    if sub is not None:
        t = torch.tensor([float(r)])
        sub.all_reduce(t)
        if t.item() != float(sum(evens)):
            raise AssertionError(f"subgroup all_reduce gave {t.item()}")
        nested = sub.new_group([0])  # nested: a group of the group
        if (nested is None) != (sub.rank != 0):
            raise AssertionError("nested new_group membership is wrong")
        if nested is not None:
            if nested.world_size != 1 or nested.all_reduce(torch.ones(2)).tolist() != [1.0, 1.0]:
                raise AssertionError("single-rank nested group must reduce to itself")
            nested.shutdown()
        sub.shutdown()
    # The parent keeps working after subgroups were used and shut down.
    t = torch.ones(1)
    backend.all_reduce(t)
    if t.item() != n:
        raise AssertionError("parent group broken after subgroup use")
    group.shutdown()


def check_stats(backend) -> None:
    backend.stats.reset()
    t = torch.zeros(10, dtype=torch.float64)
    backend.all_reduce(t)
    backend.all_reduce(t)
    backend.all_gather(torch.zeros(3, dtype=torch.float32))
    backend.broadcast(torch.zeros(2, dtype=torch.int64), 0)
    stats = backend.stats
    expected = {"all_reduce": (2, 160), "all_gather": (1, 12), "broadcast": (1, 16)}
    for op, (calls, nbytes) in expected.items():
        if stats.calls[op] != calls or stats.bytes[op] != nbytes:
            raise AssertionError(f"stats for {op}: {stats.calls[op]} calls / {stats.bytes[op]} bytes, "
                                 f"expected {calls} / {nbytes}")
    if stats.total_bytes() != 188:
        raise AssertionError(f"total_bytes {stats.total_bytes()} != 188")
    backend.stats.reset()
    if backend.stats.total_bytes() != 0 or backend.stats.calls:
        raise AssertionError("reset() must clear the counters")


def check_bad_arguments(backend) -> None:
    n = backend.world_size
    with pytest.raises(ValueError, match="out of range"):
        backend.broadcast(torch.zeros(1), n)
    with pytest.raises(ValueError, match="out of range"):
        backend.reduce(torch.zeros(1), -1)
    with pytest.raises(ValueError, match="more than once"):
        backend.new_group([0, 0])
    with pytest.raises(ValueError, match="unknown ranks"):
        backend.new_group([n])
    with pytest.raises(TypeError, match="torch.Tensor"):
        backend.all_reduce([1.0, 2.0])
    group = backend.new_group(list(range(n)))
    group.shutdown()
    group.shutdown()  # idempotent
    with pytest.raises(ValueError, match="after shutdown"):
        group.all_reduce(torch.zeros(1))
    backend.barrier()


def check_float_edge_shapes(backend) -> None:
    """0-dim and empty tensors through every collective that accepts them."""
    n, r = backend.world_size, backend.rank
    scalar = torch.tensor(float(r + 1), dtype=torch.float64)
    backend.all_reduce(scalar)
    if scalar.item() != n * (n + 1) / 2:
        raise AssertionError("0-dim all_reduce")
    if backend.all_gather(torch.tensor(float(r))).tolist() != [float(k) for k in range(n)]:
        raise AssertionError("0-dim all_gather gives one entry per rank")
    empty = torch.zeros(0, 3)
    backend.all_reduce(empty)
    if backend.all_gather(empty).shape != (0, 3) or backend.reduce_scatter(empty).shape != (0, 3):
        raise AssertionError("empty tensors keep their shape")
    backend.broadcast(torch.zeros(0), 0)
    # all_to_all of chunks without elements: no rows, and rows of no elements (rank j sends j + 1).
    if [tuple(t.shape) for t in backend.all_to_all([torch.zeros(0, 2)] * n)] != [(0, 2)] * n:
        raise AssertionError("all_to_all of empty chunks")
    got = backend.all_to_all([torch.zeros(r + 1, 0) for _ in range(n)])
    if [tuple(t.shape) for t in got] != [(j + 1, 0) for j in range(n)]:
        raise AssertionError(f"all_to_all of (rows, 0) chunks gave {[tuple(t.shape) for t in got]}")


ALL_DTYPES = tuple(DTYPES)
REDUCING_FLOATS = FLOAT_NAMES


def check_out_buffers(backend, dtype_name: str) -> None:
    """all_gather / reduce_scatter write into a caller's buffer and return it; bad buffers raise."""
    n, r = backend.world_size, backend.rank
    inputs = _inputs(n, (2, 3), dtype_name, seed=21)
    out = torch.full((2 * n, 3), 7, dtype=DTYPES[dtype_name], device=input_device())
    if backend.all_gather(inputs[r].clone(), out=out) is not out:
        raise AssertionError("all_gather(out=...) must return out")
    assert_matches(out, np.concatenate([as_numpy(t) for t in inputs]), dtype_name, "all_gather into out")
    big = _inputs(n, (2 * n, 3), dtype_name, seed=22)
    op = "MAX" if dtype_name == "bool" else "SUM"
    chunk = torch.empty((2, 3), dtype=DTYPES[dtype_name], device=input_device())
    if backend.reduce_scatter(big[r].clone(), op, out=chunk) is not chunk:
        raise AssertionError("reduce_scatter(out=...) must return out")
    full = reduce_oracle([as_numpy(t) for t in big], op, dtype_name)
    assert_matches(chunk, full[2 * r:2 * r + 2], dtype_name, "reduce_scatter into out")
    with pytest.raises(ValueError, match="shape"):
        backend.all_gather(inputs[r], out=torch.empty((2 * n + 1, 3), dtype=DTYPES[dtype_name]))
    with pytest.raises(ValueError, match="must not share storage"):
        backend.reduce_scatter(big[r], op, out=big[r][:2])


def check_async_results_not_retained(backend) -> None:
    """The backend keeps no reference to a completed asynchronous call's result: once the caller
    drops it (waited for or not), its storage is freed."""
    import gc
    import time
    import weakref
    r = backend.rank
    work = backend.all_gather(torch.full((1000,), float(r)), async_op=True)
    waited = weakref.ref(work.wait())
    unwaited_work = backend.all_gather(torch.full((1000,), float(r)), async_op=True)
    backend.barrier(async_op=True).wait()  # runs after the all_gather on the one comm thread
    unwaited = weakref.ref(unwaited_work._future.result())
    del work, unwaited_work
    deadline = time.monotonic() + 5
    while (waited() is not None or unwaited() is not None) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    if waited() is not None or unwaited() is not None:
        raise AssertionError(f"rank {r}: the backend still holds a completed async result")
    backend.barrier()


def check_byte_objects(backend) -> None:
    """distframe.backends.objects: byte strings of different lengths (empty included)."""
    from distframe.backends.objects import all_gather_bytes, broadcast_bytes
    n, r = backend.world_size, backend.rank
    mine = bytes(range(r * 3 % 256)) * (r + 1)
    if all_gather_bytes(backend, mine) != [bytes(range(k * 3 % 256)) * (k + 1) for k in range(n)]:
        raise AssertionError("all_gather_bytes lost or reordered a rank's bytes")
    src = n - 1
    got = broadcast_bytes(backend, b"from the last rank \x00\xff" if r == src else b"ignored", src)
    if got != b"from the last rank \x00\xff" or broadcast_bytes(backend, b"", 0) != b"":
        raise AssertionError(f"broadcast_bytes gave {got!r}")


def check_post_first(backend) -> None:
    """Gloo and MPI post a synchronous all_reduce, all_gather or reduce_scatter of contiguous CPU
    tensors before their bookkeeping, without the general path (``_run``); the numbering and the
    stats are the general path's. Asynchronous calls take the general path."""
    n, r, device = backend.world_size, backend.rank, input_device()
    if backend._posts_first != (backend.engine in ("gloo", "mpi")):
        raise AssertionError(f"{backend.engine} engine: _posts_first is {backend._posts_first}")
    general = []
    run = backend._run
    backend._run = lambda op, *args: general.append(op) or run(op, *args)
    try:
        seq, calls = backend._seq, dict(backend.stats.calls)
        summed = backend.all_reduce(torch.full((3,), float(r + 1), device=device), ReduceOp.AVG)
        gathered = backend.all_gather(torch.full((2,), float(r), device=device),
                                      out=torch.empty(2 * n, device=device))
        scattered = backend.reduce_scatter(torch.arange(2.0 * n, dtype=torch.float64, device=device))
        posts = backend._posts_first and device.type == "cpu"  # GPU tensors are never posted first
        expected_general = [] if posts else ["all_reduce", "all_gather", "reduce_scatter"]
        if general != expected_general:
            raise AssertionError(f"{backend.engine}: general path taken by {general}")
        backend.all_reduce(torch.ones(1, device=device), async_op=True).wait()
        if general[-1:] != ["all_reduce"]:
            raise AssertionError("an asynchronous all_reduce must take the general path")
    finally:
        del backend._run
    assert_matches(summed, np.full(3, (n + 1) / 2), "float32", "posted all_reduce AVG")
    assert_matches(gathered, np.repeat(np.arange(n, dtype=np.float64), 2), "float32", "posted all_gather")
    assert_matches(scattered, n * np.arange(2.0 * r, 2.0 * r + 2), "float64", "posted reduce_scatter")
    if backend._seq != seq + 4:
        raise AssertionError(f"4 calls moved the sequence number from {seq} to {backend._seq}")
    for op, count in (("all_reduce", 2), ("all_gather", 1), ("reduce_scatter", 1)):
        if backend.stats.calls.get(op, 0) - calls.get(op, 0) != count:
            raise AssertionError(f"stats counted {op} wrongly")


def check_tensors_that_require_grad(backend) -> None:
    """Collectives act on a tensor's data outside autograd, as torch.distributed's do (the
    differentiable ones are in ``functional``): a parameter can be broadcast, averaged, reduced
    and received into in place, results do not require grad, and backward through a tensor
    all-reduced in place runs on this rank's own graph alone (the communication is ignored)."""
    n, r = backend.world_size, backend.rank
    param = torch.nn.Parameter(torch.full((2, 3), float(r + 1), dtype=torch.float64))
    if backend.broadcast(param, n - 1) is not param or param.detach().ne(n).any():
        raise AssertionError(f"rank {r}: broadcast into a parameter gave {param.detach().tolist()}")
    if backend.all_reduce(param.t(), ReduceOp.AVG).requires_grad is not True or param.detach().ne(n).any():
        raise AssertionError("all_reduce(AVG) of a parameter's transposed view")
    backend.reduce(param, 0)
    if param.detach().ne(n * n if r == 0 else n).any():
        raise AssertionError(f"rank {r}: reduce into a parameter gave {param.detach().tolist()}")
    source = torch.nn.Parameter(torch.full((2,), float(r)))
    results = [backend.all_gather(source), backend.reduce_scatter(source.repeat(n)),
               *backend.all_to_all([source] * n), backend.scatter([source] * n if r == 0 else None, 0),
               *(backend.gather(source, 0) or [])]
    if any(t.requires_grad for t in results):
        raise AssertionError("the result of a collective must not require grad (it has no graph)")
    # out= buffers that require grad are written through a detached alias too (in-memory raised
    # torch's "functions with out=... arguments don't support automatic differentiation", Gloo
    # "a view ... is being modified inplace", MPI wrote them).
    gathered, scattered = torch.empty(2 * n, requires_grad=True), torch.empty(2, requires_grad=True)
    backend.all_gather(source, out=gathered)
    backend.reduce_scatter(source.detach().repeat(n), out=scattered)
    expected = [float(q) for q in range(n) for _ in range(2)]
    if gathered.detach().tolist() != expected or scattered.detach().tolist() != [float(sum(range(n)))] * 2:
        raise AssertionError(f"rank {r}: out= buffers that require grad got {gathered.tolist()}, "
                             f"{scattered.tolist()}")
    if n > 1:
        backend.send(source.double().repeat(2)[:3], (r + 1) % n)
        backend.recv(param[0], (r - 1) % n)  # a parameter's row, written in place
        if param.detach()[0].tolist() != [float((r - 1) % n)] * 3:
            raise AssertionError(f"rank {r}: recv into a parameter gave {param.detach().tolist()}")
    x = torch.nn.Parameter(torch.full((4,), float(r + 1), dtype=torch.float64))
    y = x * 2
    backend.all_reduce(y)
    backend.barrier()
    (y * y).sum().backward()  # d/dx of (2x reduced)^2 on this rank's graph: 2 * y * 2
    if x.grad.ne(4.0 * n * (n + 1)).any():
        raise AssertionError(f"rank {r}: gradient {x.grad.tolist()}, expected {4.0 * n * (n + 1)}")
    backend.barrier()
