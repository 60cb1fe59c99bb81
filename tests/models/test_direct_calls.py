"""The module a ZeRO-1/2/3 or FSDP model wraps, called directly (``net(x)`` instead of
``model(x)``) with grad: its gradients were never reduced and the optimizer stepped nothing (every
parameter unchanged after three steps, no error). Refused at the call, naming the fix; a direct call
under no_grad (an evaluation) computes what the wrapper's does, and DDPModel trains direct calls as
one process on the whole batch (each rank given its own slice)."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import DDPModel, FSDPModel, ZeRO1Model, ZeRO2Model, ZeRO3Model
from distframe.optimizers import DDPOptimizer, FSDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
from tests.models.common import SEED_LOCK

PAIRS = {"zero1": (ZeRO1Model, ZeRO1Optimizer), "zero2": (ZeRO2Model, ZeRO2Optimizer),
         "zero3": (ZeRO3Model, ZeRO3Optimizer), "fsdp": (FSDPModel, FSDPOptimizer),
         "ddp": (DDPModel, DDPOptimizer)}


def _net():
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(8, 4, generator=g, dtype=torch.float64),
            torch.randn(8, 2, generator=g, dtype=torch.float64))


def _direct_steps(b, strategy):
    net = _net()
    model_cls, optimizer_cls = PAIRS[strategy]
    model = model_cls(net, b)
    opt = optimizer_cls(model, torch.optim.SGD, lr=0.1)
    x, y = (t[4 * b.rank:4 * (b.rank + 1)] for t in _batch())  # each rank its own slice
    with torch.no_grad():
        evaluated = net(x)  # an evaluation: let through
        torch.testing.assert_close(evaluated, model(x), rtol=0, atol=0)
    F.mse_loss(net(x), y).backward()
    opt.step()
    return model.gather_full_parameters()


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp"])
def test_a_direct_call_with_grad_is_refused(strategy):
    with pytest.raises(ConfigError, match=r"called directly \(net\(x\)\).*Call the wrapper"):
        spawn(functools.partial(_direct_steps, strategy=strategy), 2, timeout=20)


def test_ddp_trains_a_direct_call():
    # One process on the whole batch: DDP averages the direct call's gradients across the ranks
    # (each stepped its own slice's before, 0.05 off it). float64, 1e-10.
    net = _net()
    x, y = _batch()
    F.mse_loss(net(x), y).backward()
    with torch.no_grad():
        for p in net.parameters():
            p -= 0.1 * p.grad
    for params in spawn(functools.partial(_direct_steps, strategy="ddp"), 2, timeout=20):
        for name, value in net.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10, msg=name)
