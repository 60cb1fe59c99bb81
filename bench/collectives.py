"""Collective bandwidth of every engine beside the raw call it wraps and single-thread memcpy.

    python bench/collectives.py [--engines inmemory,gloo,mpi] [--worlds 2,4] [--quick]

For each op (all_reduce, all_gather, reduce_scatter), size S (the full tensor: all_reduce's
buffer, all_gather's output, reduce_scatter's input) and world size n, prints the median time of
repeated calls, algbw = S / time and busbw (nccl-tests convention: all_reduce x 2(n-1)/n, the
others x (n-1)/n). Beside each engine: the raw library call it wraps, measured in the same run
(mpi4py in place on NumPy buffers; torch.distributed gloo), and memcpy of S bytes on one thread.
S is rounded down to a multiple of the world size (4 bytes per element), and the size column
prints what was moved. "paired time ratio", the lead figure, is the median over repeats of the
engine's time over the raw call's timed next to it, which drift of the machine between calls
moves less (at 1 MB on 2 shared cores a call's time spans 5x between its 10th and 90th
percentiles); "ratio of medians" divides the two medians, and prints '-' where it differs from
the paired ratio by more than 1.5x (call times in two modes, as at 1 KB, where the two pointed
opposite ways: 0.60 against 1.09; before the twenty-fourth session that column came first and
printed regardless). Those two time single calls after a barrier; "back to back" is the ratio of
per-call medians over blocks of 10 calls in a row (nccl-tests' way; see bench/_alternate.py).
all_gather and reduce_scatter write into preallocated outputs (``out=``) on both sides.

"busbw / memcpy bw", the in-memory target's measure: for the in-memory engine, single-thread
memcpy of S bytes is timed in the same loop as the engine's calls, alternating with them (rank 0
copies while its peers wait at a barrier), and the figure is the median over repeats of the
engine's busbw over memcpy's bandwidth in the same repeat, with memcpy's median GB/s beside it.
(Before the nineteenth session memcpy was timed once, apart, before any engine ran, and the
ratio followed that timing's noise: 1.50 / 0.44 / 0.42 at 64 MB over three runs.) For the
process engines the figure still divides by that separate timing (marked ``*``): no target
rests on it. The header line gives the intra-op thread count the in-memory ranks' calls use.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

# Run as a script, this folder comes first on sys.path and bench/attention.py would shadow the
# attention package that distframe imports: put the repository first and this folder (for the
# engines' measuring modules) last.
_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = ([os.path.dirname(_BENCH)] + [p for p in sys.path if os.path.abspath(p or ".") != _BENCH]
               + [_BENCH])

from distframe import spawn  # noqa: E402

SIZES = [2**10, 2**20, 16 * 2**20, 64 * 2**20]
OPS = ("all_reduce", "all_gather", "reduce_scatter")


def repeats_for(size: int) -> int:
    # 1 MB calls over processes have a heavy tail (a quarter of Gloo's take 4-7x the median on
    # 2 shared cores), so their medians need many samples; large calls vary little.
    return 200 if size <= 2**16 else 600 if size <= 2**22 else 40 if size <= 2**24 else 20


def busbw_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def memcpy_seconds(size: int) -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src, dst = torch.ones(size // 4), torch.empty(size // 4)
        times = []
        for _ in range(repeats_for(size)):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def _timed_memcpy(src: torch.Tensor, dst: torch.Tensor) -> float:
    """One single-thread copy of ``src`` into ``dst``, in seconds (the intra-op thread count is
    process-wide, so it is set around the copy and restored: the peers wait at a barrier)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)


def _inmemory_rank(backend, sizes, ops):
    """Per op and size: (engine seconds, memcpy seconds) per repeat, timed alternately in the
    same loop (engine first on even repeats). Each side starts after a barrier; rank 0 times the
    single-thread memcpy while its peers wait at the next barrier, so the two never overlap."""
    out = []
    for op in ops:
        for size in sizes:
            n = backend.world_size
            elems = max(n, size // 4 // n * n)  # divisible by n, as the process engines do
            x = torch.zeros(elems // n if op == "all_gather" else elems)  # sums stay finite
            buffer = {"all_gather": torch.empty(elems), "reduce_scatter": torch.empty(elems // n)}.get(op)
            kwargs = {} if buffer is None else {"out": buffer}
            src, dst = torch.ones(elems), torch.empty(elems)
            getattr(backend, op)(x, **kwargs)  # warm up both sides once
            if backend.rank == 0:
                _timed_memcpy(src, dst)
            times = []
            for i in range(repeats_for(size)):
                engine = memcpy = 0.0
                for which in ("engine", "memcpy") if i % 2 == 0 else ("memcpy", "engine"):
                    backend.barrier()
                    if which == "engine":
                        start = time.perf_counter()
                        getattr(backend, op)(x, **kwargs)
                        engine = time.perf_counter() - start
                    elif backend.rank == 0:
                        memcpy = _timed_memcpy(src, dst)
                times.append((engine, memcpy))
            out.append((op, size, elems * 4, times))
    return out


def measure_inmemory(world_size: int, sizes, ops) -> list[dict]:
    per_rank = spawn(lambda b: _inmemory_rank(b, sizes, ops), world_size)
    rows = []
    for k, (op, size, nbytes, times) in enumerate(per_rank[0]):
        # a repeat lasts until its slowest rank is done; memcpy was timed on rank 0
        engine = [max(r[k][3][i][0] for r in per_rank) for i in range(len(times))]
        memcpy = [t[1] for t in times]
        factor = busbw_factor(op, world_size)
        rows.append(dict(engine="inmemory", op=op, size_bytes=nbytes, requested_bytes=size,
                         world_size=world_size,
                         median_s=statistics.median(engine), raw_median_s=None,
                         memcpy_median_s=statistics.median(memcpy),
                         memcpy_ratio=statistics.median(factor * m / e for e, m in zip(engine, memcpy))))
    return rows


def fmt_size(size: int) -> str:
    """Whole MB or KB where the size is one, else bytes (a size rounded down to a multiple of the
    world size is not a whole KB)."""
    for unit, name in ((2**20, "MB"), (2**10, "KB")):
        if size >= unit and size % unit == 0:
            return f"{size // unit} {name}"
    return f"{size:,} B"


def _ratio_of_medians(engine_s: float, raw_s: float, paired: float) -> str:
    """The ratio of medians, or '-' where it and the paired ratio differ by more than 1.5x (a
    bimodal spread of call times, where a median can land in either mode: at 1 KB the two have
    pointed opposite ways, 0.60 against 1.09)."""
    ratio = engine_s / raw_s
    return "-" if max(ratio, paired) > 1.5 * min(ratio, paired) else f"{ratio:.3f}"


LEGEND = ("time ratios are engine / raw (below 1: the engine is faster). paired = median over repeats"
          " of the engine's time over the raw call's in the same repeat (the lead figure); ratio of"
          " medians = '-' where it differs from the paired ratio by more than 1.5x (bimodal call"
          " times); back to back = per-call medians over blocks of 10 calls. size = bytes moved"
          " (rounded down to a multiple of the world size); * = busbw over memcpy timed apart.")


def print_table(rows: list[dict], memcpy: dict[int, float]) -> None:
    print(LEGEND)
    print("| engine | op | world | size | median ms | algbw GB/s | busbw GB/s | raw call busbw GB/s "
          "| paired time ratio | ratio of medians | back to back time ratio "
          "| busbw / memcpy bw (memcpy GB/s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        size, n, t = r["size_bytes"], r["world_size"], r["median_s"]
        alg = size / t / 1e9
        bus = alg * busbw_factor(r["op"], n)
        raw = r.get("raw_median_s")
        raw_bus = f"{size / raw / 1e9 * busbw_factor(r['op'], n):.2f}" if raw else "-"
        ratio = _ratio_of_medians(t, raw, r["paired_ratio"]) if raw else "-"
        paired = f"{r['paired_ratio']:.3f}" if raw else "-"
        block = f"{r['block_median_s'] / r['block_raw_median_s']:.3f}" if raw else "-"
        if "memcpy_ratio" in r:  # interleaved with the engine's calls: median of per-repeat ratios
            mem = f"{r['memcpy_ratio']:.2f} ({size / r['memcpy_median_s'] / 1e9:.2f})"
        else:  # the separate memcpy timing before the engines ran, of the size asked for
            requested = r.get("requested_bytes", size)
            mem = f"{bus / (requested / memcpy[requested] / 1e9):.2f}*"
        print(f"| {r['engine']} | {r['op']} | {n} | {fmt_size(size)} | {t * 1e3:.3f} | {alg:.2f} | "
              f"{bus:.2f} | {raw_bus} | {paired} | {ratio} | {block} | {mem} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="inmemory,gloo,mpi", help="comma-separated engines")
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    parser.add_argument("--quick", action="store_true", help="1 KB and 1 MB only")
    args = parser.parse_args()
    sizes = SIZES[:2] if args.quick else SIZES
    engines = args.engines.split(",")
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"command: python bench/collectives.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, intra-op threads {torch.get_num_threads()} "
          "(the in-memory ranks' calls run with these; memcpy with 1)")
    memcpy = {s: memcpy_seconds(s) for s in sizes}
    print("single-thread memcpy GB/s, timed apart before the engines (the * figures): "
          + ", ".join(f"{fmt_size(s)} {s / t / 1e9:.2f}" for s, t in memcpy.items()))
    rows: list[dict] = []
    for n in worlds:
        if "inmemory" in engines:
            rows += measure_inmemory(n, sizes, OPS)
        if "gloo" in engines:
            from _gloo_collectives import measure as measure_gloo
            rows += measure_gloo(n, sizes, OPS, {s: repeats_for(s) for s in sizes})
        if "mpi" in engines:
            from _mpi_collectives import measure as measure_mpi
            rows += measure_mpi(n, sizes, OPS, {s: repeats_for(s) for s in sizes})
    print_table(rows, memcpy)


if __name__ == "__main__":
    main()
