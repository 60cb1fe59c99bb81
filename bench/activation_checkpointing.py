"""Benchmark: activation checkpointing of the LM's blocks (``--activation-checkpointing``), one
process: peak live tensor storage of a training step (forward, backward) and its time, against
the same model keeping its activations, in the same run.

Run: python bench/activation_checkpointing.py [--seq-len 1024 2048 4096] [--steps 5]
Peak memory is real tensor storage (``_storage.PeakStorage``: every op's outputs, weak references
to their storages); scratch memory of a kernel that never becomes a tensor is not counted. It is
printed twice: "op outputs", the storage the step's ops output (which is not the step's own
storage alone: ops make views of the parameters and the batch, and a view's storage is counted,
so most of the parameters come in through them), and "all live", everything live over the step
(parameters, the batch, every reachable tensor), each variant measured with only its own model
alive. Before the twenty-fourth session the two were labelled "excl. / incl. params". Step times
alternate the two variants step by step (since the nineteenth session; before, each variant's
steps ran in a block of their own).
"""
from __future__ import annotations

import argparse
import gc
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


def build(seq_len: int, checkpointing: bool, batch: int):
    """The small preset and one step of it (forward, backward, gradients dropped)."""
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
    return step


def peaks(seq_len: int, checkpointing: bool, batch: int) -> tuple[int, int]:
    """(peak bytes of the storage one step's ops output, views of the parameters and the batch
    among them; peak of everything live over a step: parameters, the batch, and anything else
    reachable included), with only this model alive."""
    step = build(seq_len, checkpointing, batch)
    step()  # warm-up
    with PeakStorage() as created:
        step()
    gc.collect()
    with PeakStorage(include_existing=True) as everything:
        step()
    return created.peak, everything.peak


def times(seq_len: int, steps: int, batch: int) -> tuple[list[float], list[float]]:
    """Step seconds of the kept and the checkpointed model, alternating step by step (kept first
    on even steps) after one warm-up step of each."""
    variants = (build(seq_len, False, batch), build(seq_len, True, batch))
    for step in variants:
        step()
    out: tuple[list[float], list[float]] = ([], [])
    for i in range(steps):
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            started = time.perf_counter()
            variants[which]()
            out[which].append(time.perf_counter() - started)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; small preset, batch {args.batch}; "
          f"step s = median of {args.steps} steps, the two variants alternating")
    print("| seq | kept: step s | kept: peak MiB, op outputs / all live | checkpointed: step s "
          "| checkpointed: peak MiB, op outputs / all live | time ratio (medians / paired) "
          "| memory ratio, op outputs / all live |")
    print("|---|---|---|---|---|---|---|")
    for seq_len in args.seq_len:
        kept_new, kept_all = peaks(seq_len, False, args.batch)
        ckpt_new, ckpt_all = peaks(seq_len, True, args.batch)
        kept_t, ckpt_t = times(seq_len, args.steps, args.batch)
        kept_s, ckpt_s = statistics.median(kept_t), statistics.median(ckpt_t)
        paired = statistics.median(c / k for k, c in zip(kept_t, ckpt_t))
        print(f"| {seq_len} | {kept_s:.3f} | {kept_new / 2**20:.1f} / {kept_all / 2**20:.1f} "
              f"| {ckpt_s:.3f} | {ckpt_new / 2**20:.1f} / {ckpt_all / 2**20:.1f} "
              f"| {ckpt_s / kept_s:.2f} / {paired:.2f} | "
              f"{ckpt_new / kept_new:.2f} / {ckpt_all / kept_all:.2f} |", flush=True)


if __name__ == "__main__":
    main()
