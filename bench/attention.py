"""Benchmark: DilatedAttention against dense SDPA (time, peak tensor memory), and ring memory.

Run: python bench/attention.py [--quick] [--seq 32768 --fwd-bwd-only]
Times: each side gets the same untimed warm-up run and the same number of timed runs at each size
(3 up to 8k, 2 above); the rows print the minimum and the median of the timed runs (the targets use
the minimum). Before the nineteenth session dense SDPA got one cold run at 32k against dilated's
best of 3.
Peak memory is real tensor storage (``_storage.PeakStorage``): a TorchDispatchMode sees every
tensor any op (forward or backward) produces and holds a weak reference to its storage; kernel
scratch buffers that never become tensors are not counted. Each row prints two peaks: "all live"
(every storage live when the run starts, q, k and v among them, plus what the ops make) and
"beyond inputs" (that less the storages of q, k and v). Before the twenty-fourth session one
figure was printed, said to exclude the inputs; it counted them (the ops make views of q, k and
v, and a view is an op output), and its "memory ratio" was dense / dilated. The ratios now say
their direction: dilated / dense. The ring part's per-rank peaks count each rank's inputs
(``PeakStorage.count``) and what its ops make, set against the single device's all-live peak.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# ``attention`` package: put the repository root there instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path
                                          if os.path.abspath(p or ".") != _HERE]

import torch
import torch.nn.functional as F

from attention import DilatedAttention, RingDilatedAttention

sys.path.append(_HERE)  # after the package: this folder's attention.py must not shadow it
from _storage import PeakStorage  # noqa: E402

SEGMENTS, RATES, HEADS, HEAD_DIM = (512, 1024, 2048), (1, 2, 4), 4, 64


def dense_sdpa(q, k, v):
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def measure(fn, seq, backward, repeats, warmup=1):
    """(min, median) wall time of ``repeats`` timed runs after ``warmup`` untimed ones, and of one
    more run: (peak storage beyond the inputs, peak of everything live) in bytes."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, seq, HEADS, HEAD_DIM, requires_grad=backward) for _ in range(3))
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        out = fn(q, k, v)
        if backward:
            out.sum().backward()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        del out
        q.grad = k.grad = v.grad = None
    return min(times), statistics.median(times), *peaks(fn, (q, k, v), backward)


def peaks(fn, inputs, backward):
    """(peak storage beyond the inputs, peak of everything live), bytes, over one run of ``fn``.
    Everything live: every storage reachable when the run starts (the inputs, and whatever else
    the process holds: nothing else in this script) and every storage an op makes during it.
    Beyond the inputs: that less what was live at the start, the inputs' storages among it (a
    view of an input is an op output, so counting op outputs alone counts the inputs)."""
    gc.collect()
    with PeakStorage(include_existing=True) as mode:
        at_start = mode.current
        out = fn(*inputs)
        if backward:
            out.sum().backward()
        del out
    for t in inputs:
        t.grad = None
    return mode.peak - at_start, mode.peak


def repeats_at(seq, repeats):
    """Timed runs at ``seq``, the same for dilated and dense: fewer above 8k, where dense SDPA
    takes 7-25 s a run."""
    return repeats if seq <= 8192 else 2


def compare(dense_seqs, dilated_seqs, repeats, passes=(False, True)):
    dilated = DilatedAttention(SEGMENTS, RATES)
    rows = {}
    for seq in dilated_seqs:
        for backward in passes:
            reps = repeats_at(seq, repeats)
            rows[(seq, backward, "dilated")] = measure(dilated, seq, backward, reps)
            if seq in dense_seqs:
                rows[(seq, backward, "dense")] = measure(dense_sdpa, seq, backward, reps)
            print_row(rows, seq, backward, reps)
    return rows


def print_row(rows, seq, backward, reps):
    kind = "fwd+bwd" if backward else "fwd"
    t, med, mem, mem_all = rows[(seq, backward, "dilated")]
    line = (f"seq {seq:>6} {kind:>7} (min / median of {reps} after 1 warm-up, each side): "
            f"dilated {t * 1e3:9.1f} / {med * 1e3:9.1f} ms, "
            f"MiB beyond inputs / all live {mem / 2**20:7.1f} / {mem_all / 2**20:7.1f}")
    if (seq, backward, "dense") in rows:
        dt, dmed, dmem, dmem_all = rows[(seq, backward, "dense")]
        line += (f" | dense SDPA {dt * 1e3:10.1f} / {dmed * 1e3:10.1f} ms, "
                 f"MiB {dmem / 2**20:7.1f} / {dmem_all / 2**20:7.1f}"
                 f" | speed-up (mins) x{dt / t:6.1f}, (medians) x{dmed / med:6.1f}"
                 f" | dilated / dense memory: beyond inputs {mem / max(dmem, 1):5.2f},"
                 f" all live {mem_all / max(dmem_all, 1):5.2f}")
    print(line, flush=True)


def ring_rank(config):
    seq, segments, rates = config

    def body(backend):
        local = seq // backend.world_size
        torch.manual_seed(backend.rank)
        q, k, v = (torch.randn(1, local, HEADS, HEAD_DIM, requires_grad=True) for _ in range(3))
        module = RingDilatedAttention(segments, rates, backend=backend)
        with PeakStorage() as mode:
            mode.count(q, k, v)
            out = module(q, k, v, is_causal=True)
            out.sum().backward()
            del out
        return mode.peak, backend.stats.total_bytes()
    return body


def ring_memory(seq):
    from distframe.launch import spawn
    configs = {"bench branches": (seq, SEGMENTS, RATES),
               "LongNet-style (w up to seq)": (seq, (2048, 8192, seq), (1, 4, 16))}
    for name, config in configs.items():
        _, segments, rates = config
        *_, single = measure(lambda q, k, v: DilatedAttention(segments, rates)(q, k, v, True),
                             seq, True, 1, warmup=0)  # everything live: inputs counted, as below
        print(f"ring, {name}, seq {seq}, causal fwd+bwd: single device {single / 2**20:.1f} MiB",
              flush=True)
        for world in (2, 4):
            results = spawn(ring_rank(config), world)
            peak = max(r[0] for r in results)
            sent = max(r[1] for r in results)
            print(f"  P={world}: per-rank peak {peak / 2**20:.1f} MiB "
                  f"({peak / single:.2f} of single device), max bytes sent per rank "
                  f"{sent / 2**20:.1f} MiB", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes only (smoke test)")
    parser.add_argument("--seq", type=int, help="one size only, both sides (dense too), no ring part")
    parser.add_argument("--fwd-bwd-only", action="store_true", help="forward+backward only")
    args = parser.parse_args()
    passes = (True,) if args.fwd_bwd_only else (False, True)
    print("command: python " + " ".join(sys.argv))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, fp32 CPU, batch 1, "
          f"embed {HEADS * HEAD_DIM}, {HEADS} heads, segments {list(SEGMENTS)}, "
          f"rates {list(RATES)}")
    if args.seq:
        compare((args.seq,), (args.seq,), repeats=3, passes=passes)
    elif args.quick:
        rows = compare((2048,), (2048, 4096), repeats=2, passes=passes)
        ring_memory(8192)
    else:
        rows = compare((2048, 8192, 32768), (2048, 8192, 32768, 65536, 131072), repeats=3)
        t32, t64 = rows[(32768, True, "dilated")][0], rows[(65536, True, "dilated")][0]
        dense32 = rows[(32768, True, "dense")][0]
        print(f"targets (minimum times): 32k fwd+bwd speed-up vs dense x{dense32 / t32:.1f} (want >= 20); "
              f"time 64k / 32k = {t64 / t32:.2f} (want <= 2.2)")
        ring_memory(32768)


if __name__ == "__main__":
    main()
