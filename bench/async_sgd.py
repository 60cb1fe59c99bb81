"""Asynchronous SGD against synchronous DDP with one deliberately slow worker, on the tiny LM.

    python bench/async_sgd.py --engine inmemory --workers 3 --max-staleness 4 --slow-delay 0.1
    python bench/async_sgd.py --engine gloo --workers 2 --max-staleness 4 --slow-delay 0.1

Both run ``--workers`` gradient workers with local batch 2; worker 1 sleeps ``--slow-delay``
seconds per step on top of its compute. Async runs first: one more rank serves; every worker
trains until a shared deadline (``--seconds``). Then DDP (``workers`` ranks) runs as many steps
as it takes to apply at least as many gradients as async did (``--ddp-steps`` fixes the count
instead), and its held-out loss is taken twice: when it has trained as long as async did (the
same wall time) and at the end (the same number of gradients). Throughput is local batches
(gradients) per second; the held-out loss is on 16 sequences, printed beside the gradients
applied before it. (Before the nineteenth session DDP ran a fixed 40 steps, 120 gradients at 3
workers, against async's ~325, and the losses were compared as they stood.)
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


def run_ddp(backend, steps, slow_delay, wall_s):
    """(gradients/s, held-out loss after all ``steps``, (gradients, held-out loss) once the
    training time first reaches ``wall_s``; the evaluation's own time is not counted)."""
    torch.set_num_threads(1)
    model = DDPModel(_model(), backend)
    opt = DDPOptimizer(model, torch.optim.AdamW, lr=1e-2)
    at_wall = None
    elapsed = 0.0
    for k in range(steps):
        start = time.perf_counter()
        if backend.rank == 0:
            time.sleep(slow_delay)
        model.train_step(_batch(1000 * backend.rank + k), _loss, opt)
        elapsed += time.perf_counter() - start
        if at_wall is None and elapsed >= wall_s:
            at_wall = ((k + 1) * backend.world_size, _held_out(model))
    return steps * backend.world_size / elapsed, _held_out(model), at_wall


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
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="inmemory", choices=["inmemory", "gloo"])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--slow-delay", type=float, default=0.1)
    parser.add_argument("--ddp-steps", type=int, default=0,
                        help="DDP steps (0: enough to apply as many gradients as async did)")
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    me = importlib.import_module("bench.async_sgd")  # processes import the functions by module
    deadline = time.time() + args.seconds + (3.0 if args.engine == "gloo" else 0.5)
    out = spawn(functools.partial(me.run_async, deadline=deadline, slow_delay=args.slow_delay,
                                  max_staleness=args.max_staleness),
                args.workers + 1, backend=args.engine, timeout=600)
    rate, loss, worst, mean, per_worker = out[0]
    grads = sum(per_worker.values())
    wall_s = grads / rate
    steps = args.ddp_steps or -(-grads // args.workers)
    ddp = spawn(functools.partial(me.run_ddp, steps=steps, slow_delay=args.slow_delay, wall_s=wall_s),
                args.workers, backend=args.engine, timeout=600)
    ddp_rate, ddp_loss, at_wall = min(r[0] for r in ddp), ddp[0][1], ddp[0][2]
    print(f"engine={args.engine} workers={args.workers} slow worker +{args.slow_delay:g} s/step, "
          f"local batch {LOCAL_BATCH}, tiny LM, AdamW lr 1e-2")
    print(f"async s={args.max_staleness}: {rate:7.2f} gradients/s over {wall_s:.1f} s; held-out loss "
          f"{loss:.3f} after {grads} gradients; staleness max {worst}, mean {mean:.2f}; "
          f"updates per worker {per_worker}")
    print(f"sync DDP : {ddp_rate:7.2f} gradients/s over {steps} steps; async / DDP throughput "
          f"{rate / ddp_rate:.2f}x")
    print(f"  held-out loss, same gradients: DDP {ddp_loss:.3f} after {steps * args.workers} "
          f"against async {loss:.3f} after {grads}")
    if at_wall is not None:
        print(f"  held-out loss, same wall time ({wall_s:.1f} s): DDP {at_wall[1]:.3f} after "
              f"{at_wall[0]} gradients against async {loss:.3f} after {grads}")
    else:
        print(f"  DDP trained less than async's {wall_s:.1f} s: no same-wall-time loss")

if __name__ == "__main__":
    main()
