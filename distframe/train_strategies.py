"""What ``--strategy`` and ``--optimizer`` may name: two small tables the trainer reads.

A strategy entry wraps the single-device model and builds its optimizer; to add one (a
model-parallel strategy, a compressed or elastic optimizer) write a ``build`` function and add a
line to ``STRATEGIES``. Model-parallel entries also say which data-parallel slice a rank trains
on (``data_parallel``) and, when ``model(inputs)`` is not the logits on every rank, how a rank
computes the validation loss (``validation_loss``). Imports of the strategies happen inside the
build functions, so ``distframe --help`` stays fast.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# build(module, backend, optimizer_cls, optimizer_kwargs) -> (wrapped model, optimizer)
Build = Callable[[nn.Module, Any, type, dict], tuple[Any, Any]]


def whole_world(model: Any, backend: Any) -> tuple[int, int]:  # noqa: ARG001
    """Pure data parallelism: every rank is its own data-parallel replica."""
    return backend.world_size, backend.rank


def plain_validation_loss(model: Any, inputs: torch.Tensor, targets: torch.Tensor,
                          loss_fn: LossFn) -> torch.Tensor:
    """Forward on this rank's slice; returns its mean loss (the same call on every rank)."""
    return loss_fn(model(inputs), targets)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy:
    """``build`` wraps the model; ``data_parallel(model, backend) -> (dp_size, dp_rank)`` says
    which slice of the global batch this rank trains on (ranks of one pipeline or tensor group
    share one); ``validation_loss(model, inputs, targets, loss_fn)`` is called on every rank and
    returns this data-parallel slice's mean loss."""

    help: str
    build: Build
    data_parallel: Callable[[Any, Any], tuple[int, int]] = whole_world
    validation_loss: Callable[[Any, torch.Tensor, torch.Tensor, LossFn], torch.Tensor] = \
        plain_validation_loss


def _ddp(module: nn.Module, backend: Any, optimizer_cls: type, kwargs: dict) -> tuple[Any, Any]:
    from distframe.models import DDPModel
    from distframe.optimizers import DDPOptimizer
    model = DDPModel(module, backend)
    return model, DDPOptimizer(model, optimizer_cls, **kwargs)


def _zero1(module: nn.Module, backend: Any, optimizer_cls: type, kwargs: dict) -> tuple[Any, Any]:
    from distframe.models import ZeRO1Model
    from distframe.optimizers import ZeRO1Optimizer
    model = ZeRO1Model(module, backend)
    return model, ZeRO1Optimizer(model, optimizer_cls, **kwargs)


def _zero2(module: nn.Module, backend: Any, optimizer_cls: type, kwargs: dict) -> tuple[Any, Any]:
    from distframe.models import ZeRO2Model
    from distframe.optimizers import ZeRO2Optimizer
    model = ZeRO2Model(module, backend)
    return model, ZeRO2Optimizer(model, optimizer_cls, **kwargs)


def _zero3(module: nn.Module, backend: Any, optimizer_cls: type, kwargs: dict) -> tuple[Any, Any]:
    from distframe.models import ZeRO3Model
    from distframe.optimizers import ZeRO3Optimizer
    model = ZeRO3Model(module, backend)
    return model, ZeRO3Optimizer(model, optimizer_cls, **kwargs)


def _fsdp(module: nn.Module, backend: Any, optimizer_cls: type, kwargs: dict) -> tuple[Any, Any]:
    from distframe.models import FSDPModel
    from distframe.optimizers import FSDPOptimizer
    model = FSDPModel(module, backend)
    return model, FSDPOptimizer(model, optimizer_cls, **kwargs)


STRATEGIES: dict[str, Strategy] = {
    "ddp": Strategy(help="replicated parameters and optimizer state, gradients all-reduced",
                    build=_ddp),
    "zero1": Strategy(help="optimizer state sharded", build=_zero1),
    "zero2": Strategy(help="optimizer state and gradients sharded", build=_zero2),
    "zero3": Strategy(help="parameters, gradients and optimizer state sharded per module",
                      build=_zero3),
    "fsdp": Strategy(help="flat parameter shards per wrapped unit", build=_fsdp),
}


def _adamw_settings(lr: float, weight_decay: float) -> dict[str, Any]:
    return {"lr": lr, "weight_decay": weight_decay, "betas": (0.9, 0.95)}


def _sgd_settings(lr: float, weight_decay: float) -> dict[str, Any]:
    return {"lr": lr, "weight_decay": weight_decay, "momentum": 0.9}


# name -> (torch.optim class, settings(lr, weight_decay) -> keyword arguments)
OPTIMIZERS: dict[str, tuple[type, Callable[[float, float], dict[str, Any]]]] = {
    "adamw": (torch.optim.AdamW, _adamw_settings),
    "sgd": (torch.optim.SGD, _sgd_settings),
}
