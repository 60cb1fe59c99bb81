"""Misuses of a sharded optimizer that failed without a word or with torch's AttributeError:
- ``opt.wrapped_optimizer.step()`` (the inner torch.optim optimizer) instead of ``opt.step()``:
  under ZeRO-1/2 the parameters were never all-gathered, so each rank's forward ran on weights
  updated in its own chunk only (0.081 off one process). Refused at that call, on every rank,
  before anything moves, for every sharded optimizer built from a class (as it was already for one
  built from an instance);
- ``model.train_step(batch, loss_fn, torch.optim.SGD)`` (the class, not an optimizer);
- the wrong optimizer for a model named a call that fails."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import DDPModel, PipelineParallelModel, ZeRO2Model
from distframe.optimizers import DDPOptimizer, ZeRO2Optimizer
from tests.models.common import SETTINGS, STRATEGIES, build_model, global_batches, loss_fn, rank_slice


def _inner_step(backend, strategy):
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(build_model(), backend, **SETTINGS[strategy])
    opt = opt_cls(model, torch.optim.SGD, lr=0.1)
    x, y = rank_slice(global_batches(1, 8)[0], backend.rank, backend.world_size)
    loss_fn(model(x), y).backward()
    before = {k: v.clone() for k, v in model.gather_full_parameters().items()}
    try:
        opt.wrapped_optimizer.step()
    except ConfigError as exc:
        after = model.gather_full_parameters()
        moved = max((after[k] - before[k]).abs().max().item() for k in before)
        opt.step()  # the call the error names still works
        return str(exc), moved
    return None, None


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_stepping_the_wrapped_optimizer_is_refused_on_every_rank(strategy):
    name = STRATEGIES[strategy][1].__name__
    for message, moved in spawn(functools.partial(_inner_step, strategy=strategy), 2, timeout=30):
        assert message is not None and f"{name}.step()" in message, message
        assert moved == 0.0


def _train_step_given(backend, model_cls, optimizer):
    model = model_cls(nn.Linear(4, 3), backend)
    model.train_step((torch.randn(2, 4), torch.randn(2, 3)), nn.functional.mse_loss, optimizer)


@pytest.mark.parametrize("model_cls", [DDPModel, ZeRO2Model])
@pytest.mark.parametrize("optimizer, inner", [(torch.optim.SGD, "torch.optim.SGD"),
                                              (ZeRO2Optimizer, "torch.optim.AdamW")])
def test_train_step_given_a_class_asks_for_an_instance(model_cls, optimizer, inner):
    with pytest.raises(ConfigError, match="an optimizer instance") as caught:
        spawn(functools.partial(_train_step_given, model_cls=model_cls, optimizer=optimizer), 2, timeout=20)
    assert f"the class {optimizer.__name__}" in str(caught.value)
    assert "model.optimizer_name" in str(caught.value)
    assert f"(model, {inner}, lr=...)" in str(caught.value)


def _wrong_model(backend, case):
    module = build_model()
    if case == "pipeline":
        DDPOptimizer(PipelineParallelModel(module, backend, num_microbatches=2), torch.optim.SGD, lr=0.1)
    elif case == "raw module":
        ZeRO2Model(module, backend)
        ZeRO2Optimizer(module, torch.optim.SGD, lr=0.1)
    else:
        ZeRO2Optimizer(DDPModel(module, backend), torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("case, works", [
    ("pipeline", "torch.optim.SGD(model.parameters(), **kwargs)"),
    ("raw module", "ZeRO2Optimizer(ZeRO2Model(module, backend), torch.optim.SGD, **kwargs)"),
    ("ddp", "DDPOptimizer(model, torch.optim.SGD, **kwargs)"),
])
def test_the_wrong_model_error_names_a_call_that_works(case, works):
    with pytest.raises(ConfigError) as caught:
        spawn(functools.partial(_wrong_model, case=case), 2, timeout=20)
    assert works in str(caught.value), str(caught.value)
