"""AsyncSGDOptimizer applies every pushed gradient exactly once (in-memory engine, float64).

The model is linear in its loss, ``loss = w . c``, so a step's gradient is its batch ``c`` whatever
the parameters, and after SGD with lr 1 the server holds ``-(sum of the applied gradients)``
exactly, in any order: a lost or repeated gradient shows as a wrong sum. Each ``c`` encodes its
worker and step, so no two gradients can cancel out."""
import functools

import pytest
import torch
from torch import nn

from distframe import spawn
from distframe.models import DDPModel
from distframe.optimizers.async_sgd import AsyncSGDOptimizer


class _Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3, dtype=torch.float64))

    def forward(self, c):
        return (self.w * c).sum()


def _gradient(rank, k):
    return torch.tensor([1.0, rank, 2.0 ** (10 * rank + k)], dtype=torch.float64)


class _Broke(RuntimeError):
    pass


def _rank(b, *, steps, fail_rank, fail_at, **settings):
    """Server: its final w and report. Worker: the sum of the gradients of its train_steps that
    returned a loss (a finite loss means the step's gradient was pushed to be applied)."""
    model = DDPModel(_Linear(), b)
    opt = AsyncSGDOptimizer(model, torch.optim.SGD, lr=1.0, **settings)
    if opt.is_server:
        report = opt.serve()
        return model.gather_full_parameters()["w"], report
    pushed = torch.zeros(3, dtype=torch.float64)
    for k in range(steps):
        def loss_fn(out, _, k=k):
            if b.rank == fail_rank and k == fail_at:
                raise _Broke(f"worker {b.rank} broke at step {k}")
            return out
        try:
            loss = opt.train_step((_gradient(b.rank, k), None), loss_fn)
        except _Broke:
            return pushed
        if loss == loss:
            pushed += _gradient(b.rank, k)
    opt.finish()
    return pushed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_every_gradient_a_worker_pushed_is_applied_once_when_a_worker_fails(policy, deterministic):
    """With on_worker_failure="stop" too: a gradient in flight when the server stops (pushed
    by a worker that already holds its loss) is applied, not dropped."""
    out = spawn(functools.partial(_rank, steps=10, fail_rank=2, fail_at=3, max_staleness=2,
                                  on_worker_failure=policy, deterministic=deterministic), 4, timeout=30)
    w, report = out[0]
    pushed = sum(out[1:])
    assert torch.equal(w, -pushed)
    assert report.updates == sum(int(p[0]) for p in out[1:]) and list(report.failed_workers) == [2]
    assert report.stopped == (policy == "stop") and report.max_staleness_seen <= 2


@pytest.fixture(scope="module")
def gloo_pool():
    from distframe._process_launch import ProcessPool
    with ProcessPool(4, "gloo", timeout=60) as pool:
        yield pool


@pytest.mark.gloo
@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_gloo_processes_apply_every_pushed_gradient_once(gloo_pool, policy):
    """The free-running server waits for each worker on a thread of its own over Gloo."""
    out = gloo_pool.run(_rank, steps=10, fail_rank=2, fail_at=3, max_staleness=2,
                        on_worker_failure=policy, worker_timeout=30)
    w, report = out[0]
    assert torch.equal(w, -sum(out[1:])) and list(report.failed_workers) == [2]
    assert report.stopped == (policy == "stop") and report.max_staleness_seen <= 2
