"""Gradient compression against uncompressed DDP on the tiny LM: bytes per step, steps/s and the
loss after N steps, per compressor, on the in-memory engine (world 4) and Gloo (world 2).

    python bench/compression.py --engine inmemory --world 4 --steps 60
    python bench/compression.py --engine gloo --world 2 --steps 60

"bytes/step" is what one rank hands to the gradient collectives per step (``backend.stats``,
the loss all_reduce excluded); "wire/step" estimates what one rank receives: ring all_reduce
2(W-1)/W x bytes, all_gather (W-1) x bytes. "bytes red." is DDP's bytes/step over a row's, "wire
red." DDP's wire/step over a row's: they differ where a compressor all-gathers (int8, top-k),
e.g. int8 at world 4 hands over 4x fewer bytes but moves only 2x fewer over the wire.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _tiny_lm import tiny_lm  # noqa: E402
from distframe import spawn  # noqa: E402
from distframe.models import DDPModel  # noqa: E402
from distframe.optimizers import DDPOptimizer  # noqa: E402
from distframe.optimizers.compressed import GradientCompressionOptimizer  # noqa: E402
from distframe.optimizers.compression import make_compressor  # noqa: E402

GLOBAL_BATCH = 8
SEQ = 32
CONFIGS = [("ddp", None, {}), ("none", "none", {}), ("fp16", "fp16", {}), ("bf16", "bf16", {}),
           ("int8", "int8", {}), ("topk-5%", "topk", {"ratio": 0.05}), ("topk-1%", "topk", {"ratio": 0.01}),
           ("powersgd-r2", "powersgd", {"rank": 2, "start_iter": 10}),
           ("powersgd-r1", "powersgd", {"rank": 1, "start_iter": 10})]


def _model() -> nn.Module:
    return tiny_lm(SEQ)


def _text() -> torch.Tensor:
    return torch.tensor(list((ROOT / "attention" / "model.py").read_bytes()))


def _batch(text: torch.Tensor, step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(text) - SEQ - 1, (GLOBAL_BATCH,), generator=g)
    tokens = torch.stack([text[i:i + SEQ + 1] for i in starts])
    n = GLOBAL_BATCH // world
    mine = tokens[rank * n:(rank + 1) * n]
    return mine[:, :-1], mine[:, 1:]


def _loss(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def measure(backend, compressor_name, settings, steps):
    """One rank's (final loss: mean of the last 5, bytes/step, wire/step, steps/s)."""
    torch.set_num_threads(1)
    model = DDPModel(_model(), backend)
    if compressor_name is None:
        opt = DDPOptimizer(model, torch.optim.AdamW, lr=1e-2)
    else:
        opt = GradientCompressionOptimizer(model, torch.optim.AdamW, lr=1e-2,
                                           compressor=make_compressor(compressor_name, **settings))
    text = _text()
    backend.stats.reset()
    start = time.perf_counter()
    losses = [model.train_step(_batch(text, s, backend.rank, backend.world_size), _loss, opt)
              for s in range(steps)]
    elapsed = time.perf_counter() - start
    stats = backend.stats.snapshot()["bytes"]
    world = backend.world_size
    reduced = stats.get("all_reduce", 0) - 8 * steps  # the float64 loss all_reduce
    gathered = stats.get("all_gather", 0)
    wire = reduced * 2 * (world - 1) / world + gathered * (world - 1)
    return sum(losses[-5:]) / 5, (reduced + gathered) / steps, wire / steps, steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="inmemory", choices=["inmemory", "gloo"])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--only", nargs="*", help="labels to run (default: all)")
    args = parser.parse_args()
    print(f"engine={args.engine} world={args.world} steps={args.steps} tiny LM (seq {SEQ}, "
          f"global batch {GLOBAL_BATCH}), AdamW lr 1e-2")
    print(f"{'compressor':<13} {'loss':>7} {'d_loss':>8} {'bytes/step':>11} {'wire/step':>11} "
          f"{'bytes red.':>10} {'wire red.':>9} {'steps/s':>8}")
    base = None
    for label, name, settings in CONFIGS:
        if args.only and label not in args.only:
            continue
        results = _spawn(args, name, settings)
        loss, sent, wire, rate = results[0][0], results[0][1], results[0][2], min(r[3] for r in results)
        base = base or (loss, sent, wire)
        print(f"{label:<13} {loss:7.4f} {loss - base[0]:+8.4f} {sent:11.0f} {wire:11.0f} "
              f"{base[1] / sent:9.1f}x {base[2] / wire:8.1f}x {rate:8.2f}", flush=True)


def _spawn(args, name, settings):
    # Gloo ranks are processes: they import the function by reference, so name it by its module.
    import functools
    import importlib
    fn = importlib.import_module("bench.compression").measure
    return spawn(functools.partial(fn, compressor_name=name, settings=settings, steps=args.steps),
                 args.world, backend=args.engine, timeout=600)


if __name__ == "__main__":
    main()
