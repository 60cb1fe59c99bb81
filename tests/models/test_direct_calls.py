"""The module a ZeRO-1/2/3 or FSDP model wraps, called directly (``net(x)`` instead of
``model(x)``) with grad: its gradients were never reduced and the optimizer stepped nothing (every
parameter unchanged after three steps, no error). Refused at the call, naming the fix; a direct call
under no_grad (an evaluation) computes what the wrapper's does, and DDPModel trains direct calls."""
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


def _direct_steps(b, strategy):
    net = _net()
    model_cls, optimizer_cls = PAIRS[strategy]
    model = model_cls(net, b)
    opt = optimizer_cls(model, torch.optim.SGD, lr=0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 4, generator=g, dtype=torch.float64)
    y = torch.randn(4, 2, generator=g, dtype=torch.float64)
    with torch.no_grad():
        evaluated = net(x)  # an evaluation: let through
        torch.testing.assert_close(evaluated, model(x), rtol=0, atol=0)
    before = model.gather_full_parameters()
    F.mse_loss(net(x), y).backward()
    opt.step()
    after = model.gather_full_parameters()
    return max((after[k] - before[k]).abs().max().item() for k in before)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp"])
def test_a_direct_call_with_grad_is_refused(strategy):
    with pytest.raises(ConfigError, match=r"called directly \(net\(x\)\).*Call the wrapper"):
        spawn(functools.partial(_direct_steps, strategy=strategy), 2, timeout=20)


def test_ddp_trains_a_direct_call():
    moved = spawn(functools.partial(_direct_steps, strategy="ddp"), 2, timeout=20)
    assert moved[0] == moved[1] > 0.01
