"""MIN and MAX of floating tensors that hold NaN and infinities, on every engine: NaN propagates
as in np.maximum / np.minimum whichever rank holds it, and every rank gets the same answer.

Transports differ here: MPI's built-in MIN/MAX and Gloo's compare with ``<``, so a NaN survived
or vanished depending on where it sat in the reduction order (on MPI, ranks of one call even got
different answers). Each engine runs every case in a few calls of one rank function; in-memory
groups are threads, Gloo and MPI ranks the persistent workers of one pool per world size.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conformance.engines import make_runner

FLOATS = ["float64", "float32", "float16", "bfloat16"]
DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}
OPS = ("min", "max")
ORACLE = {"min": np.minimum, "max": np.maximum}
ROWS_PER_RANK = 4  # inputs are (world_size * 4, 3): reduce_scatter gives each rank 4 rows
ENGINE_SPECS = ["inmemory-2", "inmemory-3", pytest.param("gloo-2", marks=pytest.mark.gloo),
                pytest.param("gloo-3", marks=pytest.mark.gloo), pytest.param("mpi-2", marks=pytest.mark.mpi),
                pytest.param("mpi-3", marks=pytest.mark.mpi)]


@pytest.fixture(scope="module", params=ENGINE_SPECS)
def runner(request):
    if request.param.startswith("mpi"):
        pytest.importorskip("mpi4py", reason="the MPI engine needs the [mpi] extra (mpi4py, mpich)")
    r = make_runner(request.param)
    yield r
    r.close()


# ---- inputs and the oracle ----------------------------------------------------------------------
def input_table(world_size: int, dtype_name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Every rank's input as rows of one float64 table (rank x element), the same on every rank.

    Small integers (exact in every dtype). For floating dtypes about a quarter of the entries are
    NaN and a fifth are infinities, and in each rank's reduce_scatter chunk the first entries are
    NaN on exactly one rank (each rank in turn), on every rank, and beside an infinity."""
    numel = int(np.prod(shape))
    rng = np.random.default_rng([seed, world_size, numel])
    table = rng.integers(-4, 5, (world_size, numel)).astype(np.float64)
    if dtype_name == "bool":
        return (table > 0).astype(np.float64)
    if dtype_name not in FLOATS:
        return table
    kinds = rng.choice(4, size=table.shape, p=[0.55, 0.25, 0.1, 0.1])
    table[kinds == 1] = np.nan
    table[kinds == 2] = np.inf
    table[kinds == 3] = -np.inf
    chunk = numel // world_size
    for c in range(world_size if numel >= world_size * (world_size + 3) else 0):
        start = c * chunk
        table[:, start:start + world_size + 3] = rng.integers(-4, 5, (world_size, world_size + 3))
        for k in range(world_size):
            table[(k + c) % world_size, start + k] = np.nan  # NaN on one rank only
        table[:, start + world_size] = np.nan  # NaN on every rank
        table[:, start + world_size + 1] = np.inf
        table[c % world_size, start + world_size + 1] = np.nan  # NaN beside +inf
        table[:, start + world_size + 2] = -np.inf
        table[(c + 1) % world_size, start + world_size + 2] = np.nan  # NaN beside -inf
    return table


def rank_input(rank: int, world_size: int, dtype_name: str, shape: tuple[int, ...] | None = None,
               seed: int = 0) -> torch.Tensor:
    shape = (world_size * ROWS_PER_RANK, 3) if shape is None else shape
    row = input_table(world_size, dtype_name, shape, seed)[rank]
    return torch.from_numpy(row.reshape(shape)).to(DTYPES[dtype_name])


def expected(world_size: int, dtype_name: str, op: str, shape: tuple[int, ...] | None = None,
             seed: int = 0) -> torch.Tensor:
    """np.maximum / np.minimum over the ranks' inputs, as the input dtype."""
    inputs = [rank_input(r, world_size, dtype_name, shape, seed) for r in range(world_size)]
    stacked = np.stack([t.to(torch.float64).numpy() for t in inputs])
    return torch.from_numpy(np.asarray(ORACLE[op].reduce(stacked, axis=0))).to(DTYPES[dtype_name])


def assert_same(actual: torch.Tensor, wanted: torch.Tensor, what: str) -> None:
    """Exactly equal, NaN in exactly the same places."""
    assert actual.dtype == wanted.dtype and actual.shape == wanted.shape, what
    torch.testing.assert_close(actual, wanted, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


# ---- functions the ranks run ------------------------------------------------------------------------
def run_all_reduce(b, dtype_names, async_op=False):
    out = {}
    for name in dtype_names:
        for op in OPS:
            t = rank_input(b.rank, b.world_size, name)
            work = b.all_reduce(t, op, async_op=async_op)
            if async_op:
                work.wait()
            out[name, op] = t
    return out


def run_small_all_reduce(b):
    """A 0-dim tensor (a flag or a norm, as in an inf/NaN check), one element, and no elements."""
    out = {}
    for name in FLOATS:
        for op in OPS:
            for shape, seed in (((), 1), ((1,), 2), ((0, 3), 3)):
                t = rank_input(b.rank, b.world_size, name, shape, seed)
                out[name, op, shape, seed] = b.all_reduce(t, op)
    return out


def run_reduce(b, dtype_names):
    out = {}
    for name in dtype_names:
        for op in OPS:
            for dst in range(b.world_size):
                t = rank_input(b.rank, b.world_size, name)
                b.reduce(t, dst, op)
                out[name, op, dst] = t
    return out


def run_reduce_scatter(b, dtype_names, async_op=False):
    out = {}
    for name in dtype_names:
        for op in OPS:
            work = b.reduce_scatter(rank_input(b.rank, b.world_size, name), op, async_op=async_op)
            out[name, op] = work.wait() if async_op else work
    return out


def run_reduce_scatter_into(b):
    """reduce_scatter into a caller's ``out`` buffer."""
    out = {}
    for name in FLOATS:
        for op in OPS:
            buffer = torch.empty((ROWS_PER_RANK, 3), dtype=DTYPES[name])
            result = b.reduce_scatter(rank_input(b.rank, b.world_size, name), op, out=buffer)
            out[name, op] = (result, result is buffer)
    return out


# ---- tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_all_reduce(runner, async_op):
    world = runner.world_size
    results = runner.run(run_all_reduce, dtype_names=list(DTYPES), async_op=async_op)
    for rank, got in enumerate(results):
        for (name, op), tensor in got.items():
            assert_same(tensor, expected(world, name, op), f"rank {rank} {name} {op}")


def test_all_reduce_small(runner):
    world = runner.world_size
    for rank, got in enumerate(runner.run(run_small_all_reduce)):
        for (name, op, shape, seed), tensor in got.items():
            assert_same(tensor, expected(world, name, op, shape, seed),
                        f"rank {rank} {name} {op} shape {shape}")


def test_reduce_every_dst(runner):
    world = runner.world_size
    for rank, got in enumerate(runner.run(run_reduce, dtype_names=list(DTYPES))):
        for (name, op, dst), tensor in got.items():
            wanted = expected(world, name, op) if rank == dst else rank_input(rank, world, name)
            assert_same(tensor, wanted, f"rank {rank} {name} {op} dst {dst}")


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_reduce_scatter(runner, async_op):
    world = runner.world_size
    results = runner.run(run_reduce_scatter, dtype_names=list(DTYPES), async_op=async_op)
    for rank, got in enumerate(results):
        for (name, op), tensor in got.items():
            wanted = expected(world, name, op).chunk(world)[rank]
            assert_same(tensor, wanted, f"rank {rank} {name} {op}")


def test_reduce_scatter_into_out(runner):
    world = runner.world_size
    for rank, got in enumerate(runner.run(run_reduce_scatter_into)):
        for (name, op), (tensor, is_buffer) in got.items():
            assert is_buffer, f"rank {rank} {name} {op}: the result is not the caller's out buffer"
            assert_same(tensor, expected(world, name, op).chunk(world)[rank], f"rank {rank} {name} {op}")


def test_the_inputs_cover_nan_on_each_rank_alone():
    """The table puts, in every reduce_scatter chunk, a NaN that only one rank holds."""
    for world in (2, 3):
        table = input_table(world, "float32", (world * ROWS_PER_RANK, 3), 0)
        lone = np.isnan(table).sum(axis=0) == 1
        for rank in range(world):
            for chunk in np.split(np.isnan(table[rank]) & lone, world):
                assert chunk.any()
