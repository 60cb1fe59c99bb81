"""MPI engine vs the raw mpi4py call it wraps, measured in one mpiexec job (used by collectives.py).

Each op and size is timed as ``_alternate`` says (single calls and back-to-back blocks, engine
and raw alternating), each after MPI's own ``Barrier``. Buffers are float32. The raw calls are the
blocking in-place forms on NumPy views of the same preallocated torch tensors the engine gets
(``Allreduce(IN_PLACE, buf)``, ``Allgather(buf, out)``, ``Reduce_scatter_block(buf, out)``); the
engine call gets preallocated outputs too (``out=``). Sizes are the full buffer: all_reduce's
tensor, all_gather's output, reduce_scatter's input.

    python bench/_mpi_collectives.py 2    # a quick table for 2 ranks
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def measure(world_size: int, sizes_bytes: Sequence[int], ops: Sequence[str] = OPS,
            repeats: int | dict[int, int] = 20) -> list[dict]:
    """One dict per (op, size): engine="mpi", op, size_bytes (moved: rounded down
    to a multiple of the world size), requested_bytes, world_size, median_s (engine call),
    raw_median_s (the raw mpi4py call)."""
    from distframe._mpi_launch import MPIPool
    unknown = set(ops) - set(OPS)
    if unknown:
        raise ValueError(f"unknown ops {sorted(unknown)}; choose from {OPS}")
    with MPIPool(world_size) as pool:
        return pool.run(_measure_on_rank, list(sizes_bytes), list(ops), repeats)[0]


def _measure_on_rank(backend, sizes_bytes: list[int], ops: list[str],
                     repeats: int | dict[int, int]) -> list[dict]:
    from mpi4py import MPI
    from _alternate import time_alternately
    raw = MPI.COMM_WORLD.Dup()
    n = backend.world_size
    rows = []

    def max_over_ranks(times):  # a call lasts until its slowest rank ends
        raw.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    for size in sizes_bytes:
        elements = max(n, size // 4 // n * n)  # divisible by the world size for reduce_scatter
        for op in ops:
            engine_call, raw_call = _calls(op, backend, raw, MPI, elements)
            count = repeats if isinstance(repeats, int) else repeats[size]
            rows.append({"engine": "mpi", "op": op, "size_bytes": elements * 4,
                         "requested_bytes": size, "world_size": n,
                         **time_alternately(raw.Barrier, max_over_ranks, engine_call, raw_call, count)})
    raw.Free()
    return rows


def _calls(op: str, backend, raw, MPI, elements: int):
    # Both calls work on the same torch-allocated tensors (the raw call on NumPy views of them), so
    # they time the same memory: NumPy's own arrays are advised into huge pages on Linux, which
    # alone made MPICH's shared-memory copies up to 1.5x faster at 16 MB, and two sets of buffers
    # of one size still differed by up to 3x at 1 MB from run to run on this machine.
    n = backend.world_size
    if op == "all_reduce":
        tensor = torch.zeros(elements)
        buf = tensor.numpy()
        return (lambda: backend.all_reduce(tensor)), (lambda: raw.Allreduce(MPI.IN_PLACE, buf))
    if op == "all_gather":  # `elements` is the gathered size: each rank contributes 1/n of it
        part, out = torch.ones(elements // n), torch.empty(elements)
        part_buf, out_buf = part.numpy(), out.numpy()
        return (lambda: backend.all_gather(part, out=out)), (lambda: raw.Allgather(part_buf, out_buf))
    tensor, out = torch.ones(elements), torch.empty(elements // n)
    buf, out_buf = tensor.numpy(), out.numpy()
    return ((lambda: backend.reduce_scatter(tensor, out=out)),
            (lambda: raw.Reduce_scatter_block(buf, out_buf)))

if __name__ == "__main__":
    # Run as a script, this folder comes first on sys.path, where bench/attention.py would shadow
    # the attention package that distframe imports: the repository goes first, this folder last.
    import os
    _BENCH = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = ([os.path.dirname(_BENCH)]
                   + [p for p in sys.path if os.path.abspath(p or ".") != _BENCH] + [_BENCH])
    import _mpi_collectives  # the ranks import the per-rank function by this name, not __main__
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    print(f"{'op':<15}{'bytes':>10}{'engine us':>12}{'raw us':>10}{'ratio':>8}")
    for row in _mpi_collectives.measure(world, [2**12, 2**16, 2**20, 2**22, 2**24]):
        print(f"{row['op']:<15}{row['size_bytes']:>10}{row['median_s'] * 1e6:>12.1f}"
              f"{row['raw_median_s'] * 1e6:>10.1f}{row['median_s'] / row['raw_median_s']:>8.3f}")
