"""ZeRO-2 on four in-memory ranks: the README's library example, runnable.

    python examples/train_spawn.py [--backend gloo]

Each rank trains on its quarter of every global batch; the parameters every rank gathers at the
end are the same, and equal those of one process training on the whole batches.
"""
import argparse
import copy

import torch

from distframe import ZeRO2Model, ZeRO2Optimizer, spawn

STEPS, GLOBAL_BATCH = 20, 32


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


# Built once, before any rank starts: in-memory ranks are threads sharing torch's global random
# generator, so seeding and initialising inside each rank would interleave their draws.
# (The model wrapper broadcasts rank 0's parameters anyway; this makes them the seeded ones.)
TEMPLATE = build_model()


def global_batches():
    g = torch.Generator().manual_seed(1234)
    w_true = torch.randn(8, 1, generator=g)
    for _ in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, 8, generator=g)
        yield x, torch.sin(x @ w_true)


def worker(backend):
    model = ZeRO2Model(copy.deepcopy(TEMPLATE), backend)
    opt = ZeRO2Optimizer(model, torch.optim.AdamW, lr=1e-2)
    per_rank = GLOBAL_BATCH // backend.world_size
    rows = slice(backend.rank * per_rank, (backend.rank + 1) * per_rank)
    losses = [model.train_step((x[rows], y[rows]), torch.nn.functional.mse_loss, opt)
              for x, y in global_batches()]
    return losses, model.gather_full_parameters()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Not "mpi": its ranks import the function they run, which a __main__ script's cannot be.
    parser.add_argument("--backend", default="inmemory", choices=["inmemory", "gloo"])
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    results = spawn(worker, args.world_size, backend=args.backend)
    losses, params = results[0]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {STEPS} steps on {args.world_size} ranks")
