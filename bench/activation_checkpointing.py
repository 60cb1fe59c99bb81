"""Benchmark: activation checkpointing of the LM's blocks (``--activation-checkpointing``), one
process: peak live tensor storage of a training step (forward, backward) and its time, against
the same model keeping its activations, in the same run.

Run: python bench/activation_checkpointing.py [--seq-len 1024 2048 4096] [--steps 5]
Peak memory is real tensor storage (``_storage.PeakStorage``: every op's outputs, weak references
to their storages); scratch memory of a kernel that never becomes a tensor is not counted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path
                                          if os.path.abspath(p or ".") != _HERE]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from attention.model import DilatedTransformerConfig, DilatedTransformerLM  # noqa: E402

sys.path.append(_HERE)  # after the package: this folder's attention.py must not shadow it
from _storage import PeakStorage  # noqa: E402


def measure(seq_len: int, checkpointing: bool, steps: int, batch: int) -> tuple[float, int]:
    """(median step seconds, peak live storage bytes of one step) of the small preset."""
    segments = tuple(min(w, seq_len) for w in (256, 512, 1024))
    config = DilatedTransformerConfig.preset("small", seq_len=seq_len, segment_lengths=segments,
                                             activation_checkpointing=checkpointing)
    torch.manual_seed(0)
    model = DilatedTransformerLM(config)
    tokens = torch.randint(0, 256, (batch, seq_len))

    def step() -> None:
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    with PeakStorage() as meter:
        step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times), meter.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; small preset, batch {args.batch}")
    print("| seq | kept: step s | kept: peak MiB | checkpointed: step s | checkpointed: peak MiB "
          "| time ratio | memory ratio |")
    print("|---|---|---|---|---|---|---|")
    for seq_len in args.seq_len:
        kept_s, kept_peak = measure(seq_len, False, args.steps, args.batch)
        ckpt_s, ckpt_peak = measure(seq_len, True, args.steps, args.batch)
        print(f"| {seq_len} | {kept_s:.3f} | {kept_peak / 2**20:.1f} | {ckpt_s:.3f} | "
              f"{ckpt_peak / 2**20:.1f} | {ckpt_s / kept_s:.2f} | {ckpt_peak / kept_peak:.2f} |")


if __name__ == "__main__":
    main()
