"""A forward of a ZeRO-3/FSDP model that raised, caught by the user (a bad batch skipped): the
units it had gathered stayed in state FORWARD, gathered, so summon_full_parameters() was refused
("entered while unit '1' ran its forward") and the full copy stayed allocated until the next step.
They are freed as the forward leaves; training then goes on as one process would (float64)."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.launch import spawn
from distframe.models import FSDPModel, ZeRO3Model
from distframe.optimizers import FSDPOptimizer, ZeRO3Optimizer
from tests.models.common import SEED_LOCK


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.fail = False

    def forward(self, x):
        h = self.fc(x)
        if self.fail:
            raise ValueError("bad batch")
        return torch.tanh(h)


def _net():
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(Block(), Block(), nn.Linear(6, 2)).double()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g, dtype=torch.float64),
             torch.randn(4, 2, generator=g, dtype=torch.float64)) for _ in range(2)]


def _skip_a_bad_batch(b, strategy):
    net = _net()
    if strategy == "fsdp":
        model = FSDPModel(net, b, auto_wrap_policy=lambda module, name: isinstance(module, Block))
        opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.1)
    else:
        model = ZeRO3Model(net, b)
        opt = ZeRO3Optimizer(model, torch.optim.SGD, lr=0.1)
    first, second = _batches()
    model.train_step(first, F.mse_loss, opt)
    net[1].fail = True
    with pytest.raises(ValueError, match="bad batch"):
        model(first[0])
    net[1].fail = False
    gathered = [u.index for u in model.units if u.is_unsharded and not u.persistent]
    with model.summon_full_parameters(writeback=False):
        pass
    model.train_step(second, F.mse_loss, opt)
    return gathered, model.gather_full_parameters()


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_a_forward_that_raised_leaves_no_unit_gathered(strategy):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in _batches():
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    for gathered, full in spawn(functools.partial(_skip_a_bad_batch, strategy=strategy), 2, timeout=20):
        assert gathered == []
        for name, value in net.state_dict().items():
            torch.testing.assert_close(full[name], value, rtol=1e-10, atol=1e-10, msg=name)
