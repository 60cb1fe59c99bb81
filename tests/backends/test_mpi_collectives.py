"""The MPI engine against a NumPy oracle: every collective, every dtype, on 2 and 3 ranks of one
persistent mpiexec job per world size (MPIPool). The functions the ranks run are module-level so
the ranks import them by reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("mpi4py", reason="the MPI engine needs the [mpi] extra (mpi4py, mpich)")

from distframe._mpi_launch import MPIPool  # noqa: E402
from distframe.backends import ReduceOp  # noqa: E402
from distframe.backends.mpi import MPICommunicationBackend  # noqa: E402

pytestmark = pytest.mark.mpi

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool]
REDUCE_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]


def rank_input(rank: int, dtype: torch.dtype, shape=(4, 3)) -> torch.Tensor:
    """Small integers (exact in every dtype, sums and products included) that differ per rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    low = 0 if dtype == torch.uint8 else -3
    return torch.randint(low, 4, shape, generator=g).to(dtype)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()


def oracle_reduce(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """What reducing ``inputs`` must give, computed in float64 NumPy and rounded once."""
    dtype = inputs[0].dtype
    stacked = np.stack([t.to(torch.float64).numpy() for t in inputs])
    if dtype == torch.bool:
        fold = {"SUM": np.any, "MAX": np.any, "PRODUCT": np.all, "MIN": np.all}[op]
        return torch.from_numpy(fold(stacked.astype(bool), axis=0))
    fold = {"SUM": np.sum, "AVG": np.sum, "PRODUCT": np.prod, "MIN": np.min, "MAX": np.max}[op]
    out = torch.from_numpy(fold(stacked, axis=0)).to(dtype)
    return out.div_(len(inputs)) if op == "AVG" else out


def op_applies(op: str, dtype: torch.dtype) -> bool:
    return not (op == "AVG" and not dtype.is_floating_point)


# ---- functions the ranks run ------------------------------------------------------------------------
def run_all_reduce(b, dtype, op):
    t = rank_input(b.rank, dtype)
    ptr = t.data_ptr()
    out = b.all_reduce(t, ReduceOp[op])
    return t, out is t and t.data_ptr() == ptr


def run_reduce_scatter(b, dtype, op):
    return b.reduce_scatter(rank_input(b.rank, dtype, (2 * b.world_size, 3)), ReduceOp[op])


def run_reduce(b, dtype, op, dst):
    t = rank_input(b.rank, dtype)
    b.reduce(t, dst, ReduceOp[op])
    return t


def run_moves(b, dtype):
    """all_gather, broadcast, gather, scatter and all_to_all of one dtype."""
    me, n = b.rank, b.world_size
    src = n - 1
    gathered = b.all_gather(rank_input(me, dtype))
    bcast = rank_input(me, dtype)
    b.broadcast(bcast, src)
    gather = b.gather(rank_input(me, dtype), 0)
    chunks = [rank_input(100 + j, dtype, (2,)) for j in range(n)] if me == src else None
    scattered = b.scatter(chunks, src)
    # chunk j from rank r has (r + j) % 3 rows: some ranks send nothing to some peers.
    a2a = b.all_to_all([rank_input(10 * me + j, dtype, ((me + j) % 3, 2)) for j in range(n)])
    return gathered, bcast, gather, scattered, a2a


def run_odd_shapes(b):
    """0-dim, empty and non-contiguous tensors through the collectives."""
    scalar = torch.tensor(float(b.rank + 1))
    b.all_reduce(scalar)
    empty = torch.empty(0, 3)
    b.all_reduce(empty)
    base = torch.arange(12.0).view(3, 4) * (b.rank + 1)
    strided = base.t()  # non-contiguous view; the result must land in `base`
    b.all_reduce(strided)
    return (scalar, b.all_gather(torch.tensor(b.rank)), empty.shape, b.all_gather(empty).shape,
            base, b.reduce_scatter(torch.ones(b.world_size, 2).t().contiguous().t()))


class _RecordingComm:
    """Forwards to an mpi4py communicator, recording the memory of each buffer handed to a
    non-blocking call as (address, nbytes)."""

    def __init__(self, comm, handed):
        self._comm, self._handed = comm, handed

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if not name.startswith("I"):
            return attr

        def recorded(*args, **kwargs):
            self._handed.append([_memory(a) for a in args if _memory(a) is not None])
            return attr(*args, **kwargs)
        return recorded


def _memory(spec):
    """(address, nbytes) of an mpi4py buffer spec: a NumPy array, or [MPI.buffer, datatype]."""
    if isinstance(spec, np.ndarray):
        return spec.ctypes.data, spec.nbytes
    if isinstance(spec, list) and spec:
        from mpi4py import MPI
        if isinstance(spec[0], MPI.buffer):
            return spec[0].address, spec[0].nbytes
        return _memory(spec[0])
    return None


class BufferSpy(MPICommunicationBackend):
    """Records the memory the engine hands to MPI, to check that it is the tensors' own."""

    def __init__(self, comm):
        super().__init__(comm)
        self.handed = []
        self._comm = _RecordingComm(self._comm, self.handed)


def run_zero_copy(b, dtype):
    spy = BufferSpy(b.comm)
    t = rank_input(b.rank, dtype, (256,))
    ptr = t.data_ptr()
    spy.all_reduce(t)
    in_place = spy.handed[-1] == [(t.data_ptr(), t.nbytes)]
    src = rank_input(b.rank, dtype, (6, 2))
    out = spy.all_gather(src)
    send, recv = spy.handed[-1]
    spy.shutdown()
    return (in_place, t.data_ptr() == ptr, send == (src.data_ptr(), src.nbytes),
            recv == (out.data_ptr(), out.nbytes))


def run_bf16_sum(b):
    # Rank 0 holds 256, the others 1: the exact sum 256 + 1 + 1 = 258 is a bfloat16, but summing
    # in bfloat16 gives 256 (256 + 1 rounds back to 256 at every step).
    t = torch.tensor([256.0 if b.rank == 0 else 1.0], dtype=torch.bfloat16)
    b.all_reduce(t)
    h = torch.tensor([256.0 if b.rank == 0 else 1.0], dtype=torch.float16).repeat(3)
    h[1] = 2048.0 if b.rank == 0 else 1.0  # float16 likewise: 2049 is not a float16, 2050 is
    b.all_reduce(h)
    return t, h


def run_async(b):
    t = torch.full((5,), float(b.rank))
    work = b.all_reduce(t, async_op=True)
    gathered = b.all_gather(torch.tensor([b.rank]), async_op=True).wait()
    return work.wait(), gathered


def run_subgroups(b):
    """A reordered subgroup of all but rank 1, and a nested group inside a full reordering."""
    n = b.world_size
    members = [n - 1, 0] if n > 2 else [1, 0]
    sub = b.new_group(members)
    first = None
    if sub is not None:
        first = (sub.rank, sub.world_size, b.rank, sub.all_gather(torch.tensor([b.rank])).tolist())
        t = torch.tensor([float(b.rank)])
        sub.all_reduce(t)
        first += (t.item(),)
    reordered = b.new_group(list(reversed(range(n))))
    nested = reordered.new_group([n - 1 - 0, 0][: n])  # positions in `reordered`
    second = None
    if nested is not None:
        second = (nested.rank, nested.all_gather(torch.tensor([b.rank])).tolist())
        nested.barrier()
    single = b.new_group([0])
    return first, (reordered.rank, reordered.world_size), second, single is not None


def run_stats(b):
    b.stats.reset()
    b.all_reduce(torch.zeros(10))                       # 40 bytes
    b.all_gather(torch.zeros(3, dtype=torch.float64))   # 24 bytes
    b.barrier()
    b.broadcast(torch.zeros(4, dtype=torch.int8), 0)
    peer = (b.rank + 1) % b.world_size
    src = (b.rank - 1) % b.world_size
    send = b.isend(torch.zeros(2), peer)
    b.recv(torch.zeros(2), src)
    send.wait()
    return b.stats.snapshot()


def run_p2p(b, dtype):
    n, me = b.world_size, b.rank
    out = rank_input(me, dtype, (3, 2))
    into = torch.zeros(2, 3, dtype=dtype).t()  # a non-contiguous receive buffer
    sends = [b.isend(out, (me + 1) % n, tag=7)]
    b.recv(into, (me - 1) % n, tag=7)
    for w in sends:
        w.wait()
    return into


def test_all_reduce_matches_oracle_and_stays_in_place(pool, dtype, op):
    if not op_applies(op, dtype):
        with pytest.raises(ValueError, match="AVG"):
            pool.run(run_all_reduce, dtype, op)
        return
    results = pool.run(run_all_reduce, dtype, op)
    expected = oracle_reduce([rank_input(r, dtype) for r in range(pool.world_size)], op)
    for t, in_place in results:
        assert in_place
        torch.testing.assert_close(t, expected, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["SUM", "MAX", "AVG"])
def test_reduce_scatter_and_reduce_match_oracle(pool, dtype, op):
    if not op_applies(op, dtype):
        with pytest.raises(ValueError, match="AVG"):
            pool.run(run_reduce_scatter, dtype, op)
        return
    n = pool.world_size
    full = oracle_reduce([rank_input(r, dtype, (2 * n, 3)) for r in range(n)], op)
    for r, chunk in enumerate(pool.run(run_reduce_scatter, dtype, op)):
        torch.testing.assert_close(chunk, full[2 * r:2 * r + 2], rtol=0, atol=0)
    reduced = pool.run(run_reduce, dtype, op, n - 1)
    torch.testing.assert_close(reduced[n - 1], oracle_reduce([rank_input(r, dtype) for r in range(n)], op),
                               rtol=0, atol=0)
    for r in range(n - 1):  # non-destination ranks keep their input
        torch.testing.assert_close(reduced[r], rank_input(r, dtype), rtol=0, atol=0)


def test_data_movement_matches_oracle(pool, dtype):
    n = pool.world_size
    results = pool.run(run_moves, dtype)
    inputs = [rank_input(r, dtype) for r in range(n)]
    for r, (gathered, bcast, gather, scattered, a2a) in enumerate(results):
        assert gathered.dtype == dtype
        np.testing.assert_array_equal(as_numpy(gathered), np.concatenate([as_numpy(t) for t in inputs]))
        np.testing.assert_array_equal(as_numpy(bcast), as_numpy(inputs[n - 1]))
        if r == 0:
            assert [as_numpy(g).tolist() for g in gather] == [as_numpy(t).tolist() for t in inputs]
        else:
            assert gather is None
        assert scattered.dtype == dtype
        np.testing.assert_array_equal(as_numpy(scattered), as_numpy(rank_input(100 + r, dtype, (2,))))
        for j, got in enumerate(a2a):
            sent = rank_input(10 * j + r, dtype, ((j + r) % 3, 2))
            assert got.shape == sent.shape and got.dtype == dtype
            np.testing.assert_array_equal(as_numpy(got), as_numpy(sent))


def test_point_to_point_ring(pool, dtype):
    n = pool.world_size
    for r, got in enumerate(pool.run(run_p2p, dtype)):
        np.testing.assert_array_equal(as_numpy(got), as_numpy(rank_input((r - 1) % n, dtype, (3, 2))))


def test_zero_copy_views_of_the_tensors(pool):
    for dtype in (torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8):
        for in_place, same_ptr, send_aliased, recv_aliased in pool.run(run_zero_copy, dtype):
            assert in_place and same_ptr, dtype
            assert send_aliased and recv_aliased, dtype


def run_address_specs(b):
    from distframe.backends.mpi_buffers import _MAX_SPECS
    wire = b._address
    t = torch.arange(12, dtype=torch.float32)
    first, again = wire(t), wire(t)
    with pytest.raises(ValueError, match="contiguous"):  # the same key as ``t``, not contiguous
        wire(t.view(3, 4).t())
    kept = [torch.zeros(k + 1) for k in range(3 * _MAX_SPECS)]
    for k in kept:
        wire(k)
    return (first is again, first[0].address == t.data_ptr(), len(first[0]) == t.nbytes,
            len(wire._specs) <= _MAX_SPECS)


def test_address_specs_are_reused_only_for_contiguous_tensors_and_bounded(pool):
    for reused, address, size, bounded in pool.run(run_address_specs):
        assert reused and address and size and bounded


def run_mpich_defaults(b):
    import os

    from distframe.backends.mpi_buffers import MPICH_DEFAULTS
    return {name: os.environ.get(name) for name in MPICH_DEFAULTS}


def test_mpich_algorithm_defaults_reach_the_ranks(pool2):
    # Set in each rank before MPI_Init (see [Note: MPICH algorithm choice]); nothing here exports them.
    from distframe.backends.mpi_buffers import MPICH_DEFAULTS
    assert MPICH_DEFAULTS == {"MPIR_CVAR_IREDUCE_SCATTER_BLOCK_INTRA_ALGORITHM": "sched_pairwise"}
    for seen in pool2.run(run_mpich_defaults):
        assert seen == MPICH_DEFAULTS


def test_bfloat16_and_float16_sums_are_rounded_once(pool3):
    results = pool3.run(run_bf16_sum)
    naive = torch.tensor([256.0], dtype=torch.bfloat16)
    for _ in range(2):
        naive = naive + torch.tensor([1.0], dtype=torch.bfloat16)  # what a bf16 MPI op would do
    assert naive.item() == 256.0
    # MPI has no bfloat16 type: reducing the raw 16-bit patterns as integers gives garbage.
    bits = sum(int(v) for v in [torch.tensor([x], dtype=torch.bfloat16).view(torch.int16).item()
                                for x in (256.0, 1.0, 1.0)])
    garbage = torch.tensor([(bits + 2**15) % 2**16 - 2**15], dtype=torch.int16).view(torch.bfloat16)
    assert garbage.item() != 258.0
    for bf16, fp16 in results:
        assert bf16.dtype == torch.bfloat16 and bf16.item() == 258.0
        assert fp16.tolist() == [258.0, 2050.0, 258.0]  # summing in float16 would give 2048


def test_odd_shapes(pool):
    n = pool.world_size
    total = n * (n + 1) / 2
    for scalar, gathered, empty_shape, gathered_empty_shape, base, rs in pool.run(run_odd_shapes):
        assert scalar.dim() == 0 and scalar.item() == total
        assert gathered.tolist() == list(range(n))
        assert empty_shape == (0, 3) and gathered_empty_shape == (0, 3)
        torch.testing.assert_close(base, torch.arange(12.0).view(3, 4) * total)
        torch.testing.assert_close(rs, torch.full((1, 2), float(n)))


def test_async_op(pool):
    n = pool.world_size
    for reduced, gathered in pool.run(run_async):
        assert reduced.tolist() == [n * (n - 1) / 2] * 5 and gathered.tolist() == list(range(n))


def test_subgroups_reordered_and_nested(pool):
    n = pool.world_size
    members = [n - 1, 0] if n > 2 else [1, 0]
    for r, (first, reordered, second, single) in enumerate(pool.run(run_subgroups)):
        if r in members:
            sub_rank, sub_size, _, gathered, total = first
            assert (sub_rank, sub_size) == (members.index(r), 2)
            assert gathered == members and total == sum(members)
        else:
            assert first is None
        assert reordered == (n - 1 - r, n)
        nested_members = [n - 1, 0]  # ranks of `reordered`, i.e. world ranks [0, n - 1]
        world_members = [n - 1 - m for m in nested_members]
        if r in world_members:
            assert second == (world_members.index(r), world_members)
        else:
            assert second is None
        assert single == (r == 0)


def test_stats_count_calls_and_bytes(pool):
    for snap in pool.run(run_stats):
        assert snap["calls"] == {"all_reduce": 1, "all_gather": 1, "barrier": 1, "broadcast": 1,
                                 "send": 1, "recv": 1}
        assert snap["bytes"] == {"all_reduce": 40, "all_gather": 24, "barrier": 0, "broadcast": 4,
                                 "send": 8, "recv": 8}


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def pool(request, pool2, pool3):
    return pool2 if request.param == 2 else pool3


@pytest.fixture(scope="module")
def pool2():
    with MPIPool(2, timeout=60) as p:
        yield p


@pytest.fixture(scope="module")
def pool3():
    with MPIPool(3, timeout=60) as p:
        yield p


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request):
    return request.param


@pytest.fixture(params=REDUCE_OPS)
def op(request):
    return request.param
