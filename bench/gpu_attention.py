"""Dilated attention on a CUDA GPU against dense SDPA (torch picks its flash kernel): bf16,
batch 1, 16 heads x 64, causal, forward+backward; median of 10 runs timed with CUDA events after
3 warm-ups, and the peak of ``torch.cuda.max_memory_allocated`` above what the inputs hold
(gradients cleared before each side and each run, so both count one set of q/k/v gradients).
Segments seq/8, seq/4, seq/2, seq at rates 1, 2, 4, 8. Needs a CUDA device."""
from __future__ import annotations

import os
import statistics
import sys

# Run as a script, this folder comes first on sys.path and bench/attention.py would shadow the
# attention package: put the repository root first instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from attention import DilatedAttention  # noqa: E402


def timed(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(fn, inputs) -> tuple[float, float]:
    """(median ms, peak MiB allocated above the starting point). The inputs' gradients are
    cleared first, so neither side's baseline holds the other's (before the nineteenth session
    dilated ran first and left q/k/v.grad, 3 x seq x 16 x 64 x 2 bytes, inside its own peak and
    in dense SDPA's baseline)."""
    for t in inputs:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = timed(fn)
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_attention.py needs a CUDA device")
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    print("| seq | dilated ms | dilated peak MiB | dense SDPA ms | dense peak MiB | dilated / dense time |")
    print("|---|---|---|---|---|---|")
    for seq in (8192, 32768, 131072):
        q, k, v = (torch.randn(1, seq, 16, 64, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn(1, seq, 16, 64, device="cuda", dtype=torch.bfloat16)
        module = DilatedAttention(tuple(seq // 8 * 2**i for i in range(4)), (1, 2, 4, 8))

        def dilated():
            q.grad = k.grad = v.grad = None  # each run makes its own gradients, as dense's does
            torch.autograd.backward(module(q, k, v, is_causal=True), grad)

        def dense():
            q.grad = k.grad = v.grad = None
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
            torch.autograd.backward(out.transpose(1, 2), grad)

        (d_ms, d_mib), (s_ms, s_mib) = measure(dilated, (q, k, v)), measure(dense, (q, k, v))
        print(f"| {seq} | {d_ms:.2f} | {d_mib:.0f} | {s_ms:.2f} | {s_mib:.0f} | {d_ms / s_ms:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
