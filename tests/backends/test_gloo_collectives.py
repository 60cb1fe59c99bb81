"""Gloo engine parity: every collective against a NumPy oracle, at world sizes 2 and 3.

The ranks are the persistent workers of one ProcessPool per world size (starting processes costs
seconds). Each test runs one function on every rank and checks the returned tensors here; the
rank functions are module-level so the workers can import them.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from distframe._process_launch import ProcessPool
from distframe.backends import GlooCommunicationBackend, ReduceOp

pytestmark = pytest.mark.gloo

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool]
OPS = ["sum", "avg", "product", "min", "max"]
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def pool(request):
    with ProcessPool(request.param, "gloo", timeout=60) as pool:
        yield pool


# ---- inputs and the oracle ----------------------------------------------------------------------
def rank_input(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0,
               op: str = "sum") -> torch.Tensor:
    """Deterministic per-rank data, small enough that no reduction overflows."""
    rng = np.random.default_rng([seed, rank])
    if dtype == torch.bool:
        values = rng.random(shape) < 0.5
    elif dtype.is_floating_point:
        values = rng.uniform(0.5, 1.5, shape) if op == "product" else rng.uniform(-2, 2, shape)
    else:
        low = 0 if dtype == torch.uint8 else -3
        values = rng.integers(low if op != "product" else 1, 4, shape)
    return torch.from_numpy(np.asarray(values)).to(dtype)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bool:
        return t.numpy()
    return (t.double() if t.dtype.is_floating_point else t.long()).numpy()


def oracle(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    stack = np.stack([to_numpy(t) for t in inputs])
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        result = stack.any(0) if op in ("sum", "max") else stack.all(0)
    else:
        result = {"sum": stack.sum, "product": stack.prod, "min": stack.min, "max": stack.max,
                  "avg": stack.mean}[op](0)
    return torch.from_numpy(np.asarray(result)).to(dtype)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCE.get(expected.dtype, 0)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def valid_ops(dtype: torch.dtype) -> list[str]:
    return [op for op in OPS if op != "avg" or dtype.is_floating_point]


def reduce_cases():
    return [pytest.param(d, op, id=f"{str(d)[6:]}-{op}") for d in DTYPES for op in valid_ops(d)]


# ---- rank functions (run in the workers) ----------------------------------------------------------
def rank_all_reduce(b, shape, dtype, op, seed):
    t = rank_input(b.rank, shape, dtype, seed, op)
    out = b.all_reduce(t, op)
    return out is t, t


def rank_all_reduce_layouts(b, dtype, op):
    scalar = rank_input(b.rank, (), dtype, 1, op)
    empty = rank_input(b.rank, (0, 3), dtype, 2, op)
    base = rank_input(b.rank, (4, 3), dtype, 3, op)
    strided = base.t()  # non-contiguous: the result must land in the caller's view
    for t in (scalar, empty, strided):
        b.all_reduce(t, op)
    return scalar, empty, strided, base


def rank_all_gather(b, dtype):
    outs = [b.all_gather(rank_input(b.rank, (2, 3), dtype, 4)),
            b.all_gather(rank_input(b.rank, (), dtype, 5)),
            b.all_gather(rank_input(b.rank, (0, 2), dtype, 6)),
            b.all_gather(rank_input(b.rank, (3, 4), dtype, 7).t())]
    return outs


def rank_reduce_scatter(b, dtype, op):
    return b.reduce_scatter(rank_input(b.rank, (2 * b.world_size, 3), dtype, 8, op), op)


def rank_broadcast(b, dtype):
    src = b.world_size - 1
    t = rank_input(b.rank, (5,), dtype, 9)
    scalar = rank_input(b.rank, (), dtype, 10)
    strided = rank_input(b.rank, (3, 2), dtype, 11).t()
    for x in (t, scalar, strided):
        b.broadcast(x, src)
    return t, scalar, strided


def rank_reduce(b, dtype, op):
    t = rank_input(b.rank, (4,), dtype, 12, op)
    b.reduce(t, b.world_size - 1, op)
    return t


def rank_gather_scatter(b, dtype):
    gathered = b.gather(rank_input(b.rank, (2, 2), dtype, 13), 0)
    src = b.world_size - 1
    chunks = [rank_input(j, (3,), dtype, 14) for j in range(b.world_size)] if b.rank == src else None
    return gathered, b.scatter(chunks, src)


def rank_all_to_all(b, dtype):
    # rank r sends r + j + 1 rows (one row: 2 elements) to rank j, rank 0 sends none to rank 0
    chunks = [rank_input(b.rank * 10 + j, ((b.rank + j) if j == b.rank else b.rank + j + 1, 2), dtype, 15)
              for j in range(b.world_size)]
    return b.all_to_all(chunks)


def rank_send_recv_ring(b, dtype):
    right, left = (b.rank + 1) % b.world_size, (b.rank - 1) % b.world_size
    b.send(rank_input(b.rank, (3, 2), dtype, 16), right, tag=5)  # every rank sends first
    received = b.recv(torch.empty((3, 2), dtype=dtype), left, tag=5)
    strided = torch.empty((2, 3), dtype=dtype).t()
    work = b.irecv(strided, left, tag=6)
    b.isend(rank_input(b.rank, (3, 2), dtype, 17), right, tag=6).wait()
    work.wait()
    return received, strided


def rank_async(b):
    t = torch.full((1000,), float(b.rank + 1))
    w1 = b.all_reduce(t, async_op=True)
    w2 = b.all_gather(torch.tensor([b.rank]), async_op=True)
    w3 = b.barrier(async_op=True)
    return w1.wait(), w2.wait(), w3.wait(), w1.is_completed()


def rank_subgroups(b):
    members = [b.world_size - 1, 0]  # renumbered: the last rank becomes 0
    sub = b.new_group(members)
    if sub is None:
        return None
    total = sub.all_reduce(torch.tensor([float(b.rank)]))
    gathered = sub.all_gather(torch.tensor([b.rank]))
    nested = sub.new_group([1])  # a group of one: the caller's rank 0 of the world
    nested_sum = nested.all_reduce(torch.tensor([5.0])) if nested is not None else None
    again = sub.new_group([0, 1])  # a second subgroup of the same parent gets its own keys
    return (sub.rank, sub.world_size, total, gathered, nested is not None and nested.rank,
            nested_sum, again.all_gather(torch.tensor([sub.rank])))


def rank_new_group_waits_for_every_member(b, delay):
    """Rank 0 finishes building its process group ``delay`` seconds late; returns when this rank
    got its group and when rank 0 had built its own."""
    cls = type(b)
    original = cls._create_process_group
    built_at = []

    def slow_build(self, *args):
        pg = original(self, *args)
        time.sleep(delay)
        built_at.append(time.time())
        return pg

    if b.rank == 0:
        cls._create_process_group = slow_build
    try:
        group = b.new_group(list(range(b.world_size)))
    finally:
        cls._create_process_group = original
    returned = time.time()
    group.shutdown()
    return returned, built_at[0] if built_at else None


def rank_build_and_drop_groups(b, count):
    for _ in range(count):
        b.new_group(list(range(b.world_size))).shutdown()  # shut down before any peer used it
    return b.all_reduce(torch.ones(1)).item()


def rank_stats(b):
    b.stats.reset()
    b.all_reduce(torch.zeros(10))                         # 40 bytes
    b.all_reduce(torch.zeros(4, dtype=torch.float64))    # 32 bytes
    b.all_gather(torch.zeros(3, dtype=torch.int64))      # 24 bytes
    b.broadcast(torch.zeros(2, dtype=torch.int8), 0)     # 2 bytes
    b.barrier()
    return b.stats.snapshot(), b.stats.total_bytes()


def rank_extra_dtypes(b):
    c = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (b.rank + 1)
    prod = torch.tensor([1 + 1j], dtype=torch.complex128)
    i16 = torch.tensor([300, -2], dtype=torch.int16) * (b.rank + 1)
    b.all_reduce(c)
    b.all_reduce(prod, "product")
    b.all_reduce(i16, "sum")
    return c, prod, i16, b.all_gather(torch.tensor([b.rank], dtype=torch.int16)), \
        b.broadcast(torch.tensor([b.rank + 1j], dtype=torch.complex64), 1)


def rank_identity(b):
    return id(b), b.rank, b.world_size, type(b).__name__


# ---- tests -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, op", reduce_cases())
def test_all_reduce_matches_numpy(pool, dtype, op):
    results = pool.run(rank_all_reduce, (3, 5), dtype, op, 0)
    expected = oracle([rank_input(r, (3, 5), dtype, 0, op) for r in range(pool.world_size)], op)
    for returned_self, t in results:
        assert returned_self
        assert_matches(t, expected)


@pytest.mark.parametrize("dtype, op", [(torch.float32, "sum"), (torch.bool, "product"),
                                       (torch.int8, "max"), (torch.bfloat16, "avg")])
def test_all_reduce_scalar_empty_and_strided(pool, dtype, op):
    n = pool.world_size
    results = pool.run(rank_all_reduce_layouts, dtype, op)
    scalar = oracle([rank_input(r, (), dtype, 1, op) for r in range(n)], op)
    strided = oracle([rank_input(r, (4, 3), dtype, 3, op) for r in range(n)], op)
    for got_scalar, got_empty, got_strided, base in results:
        assert got_scalar.shape == () and got_empty.shape == (0, 3)
        assert_matches(got_scalar, scalar)
        assert_matches(base, strided)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_all_gather_matches_numpy(pool, dtype):
    n = pool.world_size
    expected = [torch.cat([rank_input(r, (2, 3), dtype, 4) for r in range(n)]),
                torch.stack([rank_input(r, (), dtype, 5) for r in range(n)]),
                torch.empty((0, 2), dtype=dtype),
                torch.cat([rank_input(r, (3, 4), dtype, 7).t() for r in range(n)])]
    for outs in pool.run(rank_all_gather, dtype):
        for got, want in zip(outs, expected):
            assert got.shape == want.shape
            assert_matches(got, want)


@pytest.mark.parametrize("dtype, op", [pytest.param(d, op, id=f"{str(d)[6:]}-{op}")
                                       for d in (torch.float32, torch.bfloat16, torch.int64,
                                                 torch.uint8, torch.bool)
                                       for op in valid_ops(d)])
def test_reduce_scatter_matches_numpy(pool, dtype, op):
    n = pool.world_size
    full = oracle([rank_input(r, (2 * n, 3), dtype, 8, op) for r in range(n)], op)
    for rank, got in enumerate(pool.run(rank_reduce_scatter, dtype, op)):
        assert_matches(got, full[2 * rank:2 * rank + 2])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_broadcast_copies_the_source(pool, dtype):
    src = pool.world_size - 1
    for t, scalar, strided in pool.run(rank_broadcast, dtype):
        assert_matches(t, rank_input(src, (5,), dtype, 9))
        assert_matches(scalar, rank_input(src, (), dtype, 10))
        assert_matches(strided, rank_input(src, (3, 2), dtype, 11).t())


@pytest.mark.parametrize("dtype, op", [(torch.float64, "sum"), (torch.float16, "max"),
                                       (torch.int32, "product"), (torch.bool, "sum"),
                                       (torch.float32, "avg")])
def test_reduce_reaches_only_the_destination(pool, dtype, op):
    n = pool.world_size
    inputs = [rank_input(r, (4,), dtype, 12, op) for r in range(n)]
    results = pool.run(rank_reduce, dtype, op)
    assert_matches(results[n - 1], oracle(inputs, op))
    for rank in range(n - 1):
        assert_matches(results[rank], inputs[rank])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool],
                         ids=lambda d: str(d)[6:])
def test_gather_and_scatter(pool, dtype):
    n = pool.world_size
    for rank, (gathered, scattered) in enumerate(pool.run(rank_gather_scatter, dtype)):
        if rank == 0:
            assert len(gathered) == n
            for r, g in enumerate(gathered):
                assert_matches(g, rank_input(r, (2, 2), dtype, 13))
        else:
            assert gathered is None
        assert_matches(scattered, rank_input(rank, (3,), dtype, 14))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int64, torch.bool],
                         ids=lambda d: str(d)[6:])
def test_all_to_all_with_uneven_chunks(pool, dtype):
    n = pool.world_size
    for rank, received in enumerate(pool.run(rank_all_to_all, dtype)):
        assert len(received) == n
        for j, got in enumerate(received):
            rows = (j + rank) if j == rank else j + rank + 1
            assert_matches(got, rank_input(j * 10 + rank, (rows, 2), dtype, 15))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.bool],
                         ids=lambda d: str(d)[6:])
def test_send_recv_ring_buffered(pool, dtype):
    n = pool.world_size
    for rank, (received, strided) in enumerate(pool.run(rank_send_recv_ring, dtype)):
        assert_matches(received, rank_input((rank - 1) % n, (3, 2), dtype, 16))
        assert_matches(strided, rank_input((rank - 1) % n, (3, 2), dtype, 17))


def test_async_ops_return_work(pool):
    n = pool.world_size
    for reduced, gathered, barrier, completed in pool.run(rank_async):
        assert torch.equal(reduced, torch.full((1000,), float(n * (n + 1) // 2)))
        assert gathered.tolist() == list(range(n)) and barrier is None and completed


def test_nested_subgroups(pool):
    n = pool.world_size
    results = pool.run(rank_subgroups)
    last = n - 1
    sub_rank = {last: 0, 0: 1}
    for rank, result in enumerate(results):
        if rank not in sub_rank:
            assert result is None
            continue
        rank_in_sub, size, total, gathered, nested_rank, nested_sum, again = result
        assert (rank_in_sub, size) == (sub_rank[rank], 2)
        assert total.item() == float(last)
        assert gathered.tolist() == [last, 0]
        assert nested_rank == (0 if rank == 0 else False)
        assert (nested_sum is None) == (rank != 0)
        assert again.tolist() == [0, 1]


def test_new_group_returns_once_every_member_has_built_it(pool):
    """A group handed back on one rank is usable and may be shut down at once: Gloo's rendezvous
    alone can return on one rank while a peer is still connecting, and a shutdown then broke the
    peer's construction ("Connection closed by peer")."""
    results = pool.run(rank_new_group_waits_for_every_member, 0.5)
    built = results[0][1]
    assert all(returned >= built for returned, _ in results), (built, results)
    assert pool.run(rank_build_and_drop_groups, 30) == [float(pool.world_size)] * pool.world_size


def test_stats_count_calls_and_bytes(pool):
    for snapshot, total in pool.run(rank_stats):
        assert snapshot["calls"] == {"all_reduce": 2, "all_gather": 1, "broadcast": 1, "barrier": 1}
        assert snapshot["bytes"] == {"all_reduce": 72, "all_gather": 24, "broadcast": 2, "barrier": 0}
        assert total == 98


def test_complex_and_int16_are_composed(pool):
    n = pool.world_size
    scale = n * (n + 1) // 2
    for c, prod, i16, gathered, bcast in pool.run(rank_extra_dtypes):
        torch.testing.assert_close(c, torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * scale)
        torch.testing.assert_close(prod, torch.tensor([(1 + 1j) ** n], dtype=torch.complex128))
        assert torch.equal(i16, (torch.tensor([300, -2]) * scale).to(torch.int16))
        assert gathered.tolist() == list(range(n)) and gathered.dtype == torch.int16
        assert bcast.tolist() == [1 + 1j]


def test_pool_keeps_backends_between_runs(pool):
    first, second = pool.run(rank_identity), pool.run(rank_identity)
    assert first == second
    assert [(r, n, name) for _, r, n, name in first] == [
        (r, pool.world_size, "GlooCommunicationBackend") for r in range(pool.world_size)]


def test_single_rank_group_in_process():
    store = torch.distributed.HashStore()
    with GlooCommunicationBackend(0, 1, store, timeout=10) as b:
        t = torch.tensor([2.0, 3.0])
        assert b.all_reduce(t, ReduceOp.PRODUCT) is t and t.tolist() == [2.0, 3.0]
        assert b.all_gather(torch.tensor(4)).tolist() == [4]
        assert b.all_to_all([torch.ones(2, 2)])[0].shape == (2, 2)
        assert b.new_group([0]).world_size == 1
