"""IShardedModel and IShardedOptimizer (DESIGN.md, Models and optimizers): every strategy
implements them with compatible signatures, and live objects pass isinstance."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import distframe
from distframe import IShardedModel, IShardedOptimizer, spawn
from distframe.models import (DDPModel, FSDPModel, HybridShardedModel, PipelineParallelModel,
                              TensorParallelModel, ZeRO1Model, ZeRO2Model, ZeRO3Model)
from distframe.optimizers import (AsyncSGDOptimizer, DDPOptimizer, ElasticOptimizer, FSDPOptimizer,
                                  GradientCompressionOptimizer, ZeRO1Optimizer, ZeRO2Optimizer,
                                  ZeRO3Optimizer)

MODELS = [DDPModel, ZeRO1Model, ZeRO2Model, ZeRO3Model, FSDPModel, PipelineParallelModel,
          TensorParallelModel, HybridShardedModel]
OPTIMIZERS = [DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer, FSDPOptimizer,
              GradientCompressionOptimizer, AsyncSGDOptimizer, ElasticOptimizer]


def protocol_methods(protocol: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(protocol).items()
            if inspect.isfunction(member) and not name.startswith("_")}


def assert_compatible(cls: type, protocol: type) -> None:
    """Each protocol method exists on ``cls`` and accepts the protocol's parameters by the same
    names and kinds (it may add keyword-only ones with defaults)."""
    methods = protocol_methods(protocol)
    assert methods, protocol
    for name, wanted in methods.items():
        got = inspect.signature(getattr(cls, name))
        params = got.parameters
        takes_var = any(p.kind is p.VAR_POSITIONAL for p in params.values())
        takes_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for param in wanted.parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                assert (takes_var if param.kind is param.VAR_POSITIONAL else takes_kw), (cls, name)
                continue
            assert param.name in params or takes_kw, f"{cls.__name__}.{name} lacks {param.name}"
        extra = [p for p in params.values() if p.name not in wanted.parameters
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.default is p.empty]
        assert not extra, f"{cls.__name__}.{name} requires {[p.name for p in extra]} beyond the protocol"


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_every_model_strategy_implements_the_model_protocol(cls):
    assert_compatible(cls, IShardedModel)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_every_optimizer_strategy_implements_the_optimizer_protocol(cls):
    assert_compatible(cls, IShardedOptimizer)


def test_the_check_rejects_a_method_that_needs_more_than_the_protocol_gives():
    class Stricter(DDPOptimizer):
        def should_early_stop(self, local_flag, group):  # noqa: ARG002
            return False
    with pytest.raises(AssertionError, match="requires \\['group'\\]"):
        assert_compatible(Stricter, IShardedOptimizer)


def test_live_objects_pass_isinstance_and_plain_torch_ones_do_not():
    def worker(backend):
        found = []
        for model_cls, optimizer_cls in [(DDPModel, DDPOptimizer), (ZeRO3Model, ZeRO3Optimizer),
                                         (FSDPModel, FSDPOptimizer)]:
            model = model_cls(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).double(), backend)
            optimizer = optimizer_cls(model, torch.optim.Adam, lr=0.1)
            found.append((isinstance(model, IShardedModel), isinstance(optimizer, IShardedOptimizer)))
        return found
    assert spawn(worker, 2) == [[(True, True)] * 3] * 2
    plain = nn.Linear(2, 2)
    assert not isinstance(plain, IShardedModel)
    assert not isinstance(torch.optim.SGD(plain.parameters(), lr=0.1), IShardedOptimizer)
    assert {"IShardedModel", "IShardedOptimizer"} <= set(distframe.__all__)
