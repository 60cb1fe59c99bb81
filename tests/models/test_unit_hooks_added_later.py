"""A forward hook that a user registers on a unit's module after wrapping it in ZeRO-3/FSDP runs
while the unit's parameters are whole. torch runs a module's hooks in registration order, and the
unit's own hook, which reshards it, came first: such a hook read the NaN stand-in (silently after
the first step; at the first a ConfigError blamed a read outside the unit's forward). See [Note:
hooks added later] in distframe/models/unit_lifecycle.py."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe import spawn
from tests.models.common import SEED_LOCK, STRATEGIES

X, Y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)


def build():
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 9), nn.Tanh(), nn.Linear(9, 9), nn.Tanh(), nn.Linear(9, 2)).double()


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_a_hook_added_after_wrapping_reads_the_whole_weight(strategy):
    want = build()[2].weight.norm().item()
    settings = {"fsdp": {"auto_wrap_min_params": 50}}.get(strategy, {})

    def run(backend):
        seen = []
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build(), backend, **settings)
        opt = opt_cls(model, torch.optim.SGD, lr=0.0)  # the weights stay what build() made
        read = lambda module, args, output: seen.append(module.weight.detach().norm().item())  # noqa: E731
        handle = model.module[2].register_forward_hook(read)  # before the first step
        model.train_step((X[:2], Y[:2]), F.mse_loss, opt)
        handle.remove()
        model.module[2].register_forward_hook(read)  # after it
        model.train_step((X[:2], Y[:2]), F.mse_loss, opt)
        return seen

    for seen in spawn(run, 2, timeout=20):
        assert seen == [pytest.approx(want, rel=1e-15)] * 2, seen
