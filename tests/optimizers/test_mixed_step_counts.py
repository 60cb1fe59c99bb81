"""A checkpoint whose Adam step counts differ per parameter (DDPModel(find_unused_parameters=True)
steps a parameter only in steps that gave it a gradient) loaded where one optimizer shard holds
parameters saved with different counts (a ZeRO-1/2 chunk, an FSDP unit): it took the first
parameter's count for the whole shard, so the others resumed with wrong bias corrections
(2e-2 off one process after three steps, silently). That is a ConfigError now, on every rank;
DDPModel (per-parameter state) and ZeRO3Model (per-module state, and here each module's
parameters share their count) resume as one process does."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe import ConfigError, checkpoint, spawn
from distframe.models import DDPModel, FSDPModel, ZeRO1Model, ZeRO2Model, ZeRO3Model
from distframe.optimizers import (DDPOptimizer, FSDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer,
                                  ZeRO3Optimizer)
from tests.models.common import SEED_LOCK

USE_EXTRA = [True, False, False, True, True, True]  # 'extra' unused in steps 1 and 2
SAVED_AT = 3
STRATEGIES = {"ddp": (DDPModel, DDPOptimizer), "zero1": (ZeRO1Model, ZeRO1Optimizer),
              "zero2": (ZeRO2Model, ZeRO2Optimizer), "zero3": (ZeRO3Model, ZeRO3Optimizer),
              "fsdp": (FSDPModel, FSDPOptimizer)}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.extra = nn.Linear(5, 5)
        self.c = nn.Linear(5, 3)
        self.use_extra = True

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(torch.tanh(self.extra(h)) if self.use_extra else h)


def build():
    with SEED_LOCK:
        torch.manual_seed(0)
        return Net().double()


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=g, dtype=torch.float64),
             torch.randn(6, 3, generator=g, dtype=torch.float64)) for _ in USE_EXTRA]


def reference():
    net = build()
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    for use, (x, y) in zip(USE_EXTRA, batches()):
        net.use_extra = use
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in net.named_parameters()}


def train(model, net, opt, backend, steps):
    for step in steps:
        x, y = batches()[step]
        per = x.shape[0] // backend.world_size
        net.use_extra = USE_EXTRA[step]
        model.train_step((x[backend.rank * per:(backend.rank + 1) * per],
                          y[backend.rank * per:(backend.rank + 1) * per]), F.mse_loss, opt)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "ckpt"

    def run(backend):
        net = build()
        model = DDPModel(net, backend, find_unused_parameters=True)
        opt = DDPOptimizer(model, torch.optim.Adam, lr=0.05)
        train(model, net, opt, backend, range(SAVED_AT))
        checkpoint.save(path, model, opt, step=SAVED_AT)
        return {n: float(opt.state[p]["step"]) for n, p in net.named_parameters()}
    counts = spawn(run, 2, timeout=60)[0]
    assert counts["extra.weight"] == 1.0 and counts["a.weight"] == 3.0  # what the test is about
    return path


def resume(path, strategy, world, **settings):
    def run(backend):
        net = build()
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(net, backend, **settings)
        opt = opt_cls(model, torch.optim.Adam, lr=0.05)
        checkpoint.load(path, model, opt)
        train(model, net, opt, backend, range(SAVED_AT, len(USE_EXTRA)))
        return model.gather_full_parameters()
    return spawn(run, world, timeout=60)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp"])
def test_a_shard_mixing_parameters_saved_with_different_step_counts_is_refused(saved, strategy, world):
    # At world 3 only one rank's ZeRO chunk mixes them: every rank raises (checkpoint.load agrees).
    settings = {"auto_wrap_min_params": 1000} if strategy == "fsdp" else {}  # FSDP: one unit
    with pytest.raises(ConfigError, match=r"different optimizer state 'step'.*load the checkpoint under "
                                          r"DDPModel.*ZeRO3Model.*without the optimizer"):
        resume(saved, strategy, world, **settings)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_per_parameter_and_per_module_state_resume_as_one_process(saved, strategy, world):
    expected = reference()
    for got in resume(saved, strategy, world):
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-10, msg=name)
