"""Gloo engine vs the raw torch.distributed gloo call it wraps, in one set of processes
(used by collectives.py).

The ranks are spawned once (a ProcessPool). The raw calls run on the engine's own
``ProcessGroupGloo`` object, the one torch.distributed's functions call into:
``pg.allreduce([t])``, ``pg._allgather_base(out, t)`` (what ``dist.all_gather_into_tensor``
runs) and ``pg._reduce_scatter_base(out, t)`` (``dist.reduce_scatter_tensor``), each waited
for, on preallocated outputs; the engine call gets preallocated outputs too (``out=``). One
process group for both, because two groups of the same kind, timed alternately, differed by up
to 2x at 1 MB and by a different factor in each run (each group's TCP connections settle into
their own pace on 2 shared cores; measured with the engine's group beside a separate
``init_process_group`` world), which compared connections, not the engine. Each op and size is
timed as ``_alternate`` says (single calls and back-to-back blocks, engine and raw alternating),
each after the process group's own barrier. Tensors are float32. Sizes are the full buffer:
all_reduce's tensor, all_gather's output, reduce_scatter's input.

    python bench/_gloo_collectives.py 2    # a quick table for 2 ranks
"""
from __future__ import annotations

import datetime
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def measure(world_size: int, sizes_bytes: Sequence[int], ops: Sequence[str] = OPS,
            repeats: int | dict[int, int] = 20) -> list[dict]:
    """One dict per (op, size): engine="gloo", op, size_bytes (moved: rounded down
    to a multiple of the world size), requested_bytes, world_size, median_s (engine call),
    raw_median_s (the raw torch.distributed call)."""
    from distframe._process_launch import ProcessPool
    unknown = set(ops) - set(OPS)
    if unknown:
        raise ValueError(f"unknown ops {sorted(unknown)}; choose from {OPS}")
    with ProcessPool(world_size, "gloo", timeout=300) as pool:
        return pool.run(_measure_on_rank, list(sizes_bytes), list(ops), repeats)[0]


def _measure_on_rank(backend, sizes_bytes: list[int], ops: list[str],
                     repeats: int | dict[int, int]) -> list[dict]:
    from _alternate import time_alternately
    n = backend.world_size
    # The process group's own barrier, as the MPI side uses MPI's: no engine code runs before a call.
    barrier = lambda: backend._pg.barrier().wait()  # noqa: E731
    rows = []

    def max_over_ranks(times):  # a call lasts until its slowest rank is done
        backend.all_reduce(torch.from_numpy(times), op="max")
    for op in ops:
        for size in sizes_bytes:
            elements = max(n, size // 4 // n * n)  # divisible by n for reduce_scatter
            engine_call, raw_call = _calls(op, backend, elements)
            rows.append({"engine": "gloo", "op": op, "size_bytes": elements * 4,
                         "requested_bytes": size, "world_size": n,
                         **time_alternately(barrier, max_over_ranks, engine_call, raw_call,
                                            repeats if isinstance(repeats, int) else repeats[size])})
    return rows


def _join_raw_world(backend) -> None:
    """The default torch.distributed group, on a store rank 0 hosts (its port sent through the
    engine, so no port is guessed)."""
    store = None
    port = torch.zeros(1, dtype=torch.int64)
    if backend.rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, backend.world_size, is_master=True,
                              wait_for_workers=False, timeout=datetime.timedelta(seconds=300))
        port[0] = store.port
    backend.broadcast(port, 0)
    if store is None:
        store = dist.TCPStore("127.0.0.1", int(port), is_master=False,
                              timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=backend.rank, world_size=backend.world_size,
                            timeout=datetime.timedelta(seconds=300))


def _calls(op: str, backend, elements: int):
    n = backend.world_size
    pg = backend._pg  # the engine's ProcessGroupGloo: see the module docstring
    tensor = torch.zeros(elements)  # zeros: repeated in-place sums stay finite
    if op == "all_reduce":
        return (lambda: backend.all_reduce(tensor)), (lambda: pg.allreduce([tensor]).wait())
    if op == "all_gather":  # `elements` is the gathered size: each rank contributes 1/n of it
        part, out, raw_out = torch.zeros(elements // n), torch.empty(elements), torch.empty(elements)
        return ((lambda: backend.all_gather(part, out=out)),
                (lambda: pg._allgather_base(raw_out, part).wait()))
    out, raw_out = torch.empty(elements // n), torch.empty(elements // n)
    options = dist.ReduceScatterOptions()
    options.reduceOp = dist.ReduceOp.SUM
    return ((lambda: backend.reduce_scatter(tensor, out=out)),
            (lambda: pg._reduce_scatter_base(raw_out, tensor, options).wait()))


if __name__ == "__main__":
    # Run as a script, this folder comes first on sys.path, where bench/attention.py would shadow
    # the attention package that distframe imports: the repository goes first, this folder last.
    import os
    _BENCH = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = ([os.path.dirname(_BENCH)]
                   + [p for p in sys.path if os.path.abspath(p or ".") != _BENCH] + [_BENCH])
    import _gloo_collectives  # the ranks import the per-rank function by this name, not __main__
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    print(f"{'op':<15}{'bytes':>10}{'engine us':>12}{'raw us':>10}{'ratio':>8}")
    for row in _gloo_collectives.measure(world, [2**12, 2**16, 2**20, 2**22, 2**24], repeats=repeats):
        print(f"{row['op']:<15}{row['size_bytes']:>10}{row['median_s'] * 1e6:>12.1f}"
              f"{row['raw_median_s'] * 1e6:>10.1f}{row['median_s'] / row['raw_median_s']:>8.3f}")
