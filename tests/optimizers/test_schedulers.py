"""Sharded optimizers are torch.optim optimizers to learning-rate schedulers: a scheduler over
each strategy's optimizer trains as it does over Adam on the unwrapped model (float64, 1e-10)."""
from __future__ import annotations

import pytest
import torch

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.optimizers import ZeRO1Optimizer
from tests.models.common import SETTINGS, STRATEGIES, build_model, global_batches, loss_fn, rank_slice

STEPS = 4


def schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_scheduler_over_a_sharded_optimizer_equals_the_whole_model(strategy):
    batches = global_batches(STEPS, 12)
    reference = build_model()
    opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    sched = schedule(opt)
    for x, y in batches:
        loss_fn(reference(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        sched = schedule(opt)
        for batch in batches:
            model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
            sched.step()
        return opt.param_groups[0]["lr"], model.gather_full_parameters()
    for lr, params in spawn(run, 2, timeout=30):
        assert lr == pytest.approx(1e-2 / (1 + STEPS), rel=1e-15)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=1e-10, atol=1e-10, msg=name)


def test_a_sharded_optimizer_inside_another_is_a_config_error():
    def run(backend):
        model_cls, opt_cls = STRATEGIES["zero1"]
        model = model_cls(build_model(), backend)
        inner = opt_cls(model, torch.optim.Adam, lr=1e-2)
        with pytest.raises(ConfigError, match="torch.optim class"):
            ZeRO1Optimizer(model, inner)
        with pytest.raises(ConfigError, match="torch.optim class"):
            ZeRO1Optimizer(model, ZeRO1Optimizer, lr=1e-2)
        with pytest.raises(ConfigError, match="cannot take more"):
            inner.add_param_group({"params": [torch.zeros(1)]})
    spawn(run, 1)
