"""Asynchronous SGD against synchronous DDP with one deliberately slow worker, on the tiny LM.

    python bench/async_sgd.py --engine inmemory --workers 3 --max-staleness 4 --slow-delay 0.1
    python bench/async_sgd.py --engine gloo --workers 2 --max-staleness 4 --slow-delay 0.1

Both run ``--workers`` gradient workers with local batch 2; worker 1 sleeps ``--slow-delay``
seconds per step on top of its compute. DDP: ``workers`` ranks, a fixed number of steps.
Async: one more rank serves; every worker trains until a shared deadline. Throughput is local
batches (gradients) per second; the held-out loss is measured afterwards on 16 sequences.
"""
from __future__ import annotations

import argparse
import functools
import importlib
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
from distframe.optimizers.async_sgd import AsyncSGDOptimizer  # noqa: E402

SEQ, LOCAL_BATCH = 32, 2


def _model() -> nn.Module:
    return tiny_lm(SEQ)


def _batch(seed: int, size: int = LOCAL_BATCH):
    text = torch.tensor(list((ROOT / "attention" / "model.py").read_bytes()))
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(text) - SEQ - 1, (size,), generator=g)
    tokens = torch.stack([text[i:i + SEQ + 1] for i in starts])
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _held_out(model) -> float:
    x, y = _batch(10**6, 16)
    with torch.no_grad():
        return float(_loss(model(x), y))


def run_ddp(backend, steps, slow_delay):
    torch.set_num_threads(1)
    model = DDPModel(_model(), backend)
    opt = DDPOptimizer(model, torch.optim.AdamW, lr=1e-2)
    start = time.perf_counter()
    for k in range(steps):
        if backend.rank == 0:
            time.sleep(slow_delay)
        model.train_step(_batch(1000 * backend.rank + k), _loss, opt)
    elapsed = time.perf_counter() - start
    return steps * backend.world_size / elapsed, _held_out(model)


def run_async(backend, deadline, slow_delay, max_staleness):
    torch.set_num_threads(1)
    model = DDPModel(_model(), backend)
    opt = AsyncSGDOptimizer(model, torch.optim.AdamW, lr=1e-2, max_staleness=max_staleness,
                            staleness_lr=True)
    if opt.is_server:
        report = opt.serve()
        return report.updates / report.wall_s, _held_out(model), report.max_staleness_seen, \
            report.mean_staleness, dict(report.updates_per_worker)
    k = 0
    while time.time() < deadline:
        if backend.rank == 1:
            time.sleep(slow_delay)
        opt.train_step(_batch(1000 * backend.rank + k), _loss)
        k += 1
    opt.finish()
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="inmemory", choices=["inmemory", "gloo"])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--slow-delay", type=float, default=0.1)
    parser.add_argument("--ddp-steps", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    me = importlib.import_module("bench.async_sgd")  # processes import the functions by module
    ddp = spawn(functools.partial(me.run_ddp, steps=args.ddp_steps, slow_delay=args.slow_delay),
                args.workers, backend=args.engine, timeout=600)
    ddp_rate, ddp_loss = min(r[0] for r in ddp), ddp[0][1]
    deadline = time.time() + args.seconds + (3.0 if args.engine == "gloo" else 0.5)
    out = spawn(functools.partial(me.run_async, deadline=deadline, slow_delay=args.slow_delay,
                                  max_staleness=args.max_staleness),
                args.workers + 1, backend=args.engine, timeout=600)
    rate, loss, worst, mean, per_worker = out[0]
    print(f"engine={args.engine} workers={args.workers} slow worker +{args.slow_delay:g} s/step, "
          f"local batch {LOCAL_BATCH}, tiny LM, AdamW lr 1e-2")
    print(f"sync DDP : {ddp_rate:7.2f} gradients/s over {args.ddp_steps} steps; held-out loss {ddp_loss:.3f}")
    print(f"async s={args.max_staleness}: {rate:7.2f} gradients/s ({rate / ddp_rate:.2f}x); held-out loss "
          f"{loss:.3f}; staleness max {worst}, mean {mean:.2f}; updates per worker {per_worker}")


if __name__ == "__main__":
    main()
