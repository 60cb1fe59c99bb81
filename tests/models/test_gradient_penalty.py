"""A gradient penalty on DDP and ZeRO-1/2 (the WGAN-GP / R1 / physics-informed pattern): the loss
holds d(output)/d(input), taken with ``torch.autograd.grad(..., create_graph=True)``, and one
``backward()`` then differentiates it. The inner pass accumulates into no parameter, so it must
not end the step's gradient reductions (before: it reduced zeros, warned of unused parameters, and
the real backward then failed with 'a gradient arrived for bucket 0 after it was reduced'). Each
strategy equals one process on the global batch, float64, to 1e-12."""
import copy

import pytest
import torch
from torch import nn

from distframe import spawn
from tests.models.common import SEED_LOCK, SETTINGS, STRATEGIES

WORLD, ROWS, STEPS = 2, 8, 3
TOLERANCE = 1e-12


def build():
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                             nn.Linear(16, 1)).double()


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, 4, generator=g, dtype=torch.float64)


def penalised_loss(model, x):
    """Mean output plus the mean of (|d out / d x| - 1)^2 over the rows (WGAN-GP's penalty):
    per-row terms, so the mean over the global batch is the mean of the ranks' means."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.mean() + ((grad.norm(dim=1) - 1) ** 2).mean()


def one_process():
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        penalised_loss(model, batch(step)).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_gradient_penalty_equals_one_process(strategy):
    model_cls, opt_cls = STRATEGIES[strategy]

    def run(backend):
        model = model_cls(copy.deepcopy(build()), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.SGD, lr=0.1, momentum=0.9)
        rows = slice(backend.rank * ROWS // WORLD, (backend.rank + 1) * ROWS // WORLD)
        for step in range(STEPS):
            opt.zero_grad()
            penalised_loss(model, batch(step)[rows]).backward()
            opt.step()
        return model.gather_full_parameters()

    want = one_process()
    for params in spawn(run, WORLD, timeout=20):
        for name, value in want.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=TOLERANCE)
