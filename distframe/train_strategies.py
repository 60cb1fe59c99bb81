"""What ``--strategy`` and ``--optimizer`` may name: two small tables the trainer reads.

A strategy entry wraps the single-device model and builds its optimizer; to add one (a
model-parallel strategy, a compressed or elastic optimizer) write a ``build`` function and add a
line to ``STRATEGIES``. Which data-parallel slice a rank trains on and how it computes the
validation loss come from the wrapped model's ``data_parallel_coordinates()`` and
``validation_loss()`` when it has them (model-parallel strategies), or from the entry. Imports of the strategies happen inside the
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


def model_data_parallel(model: Any, backend: Any) -> tuple[int, int]:
    """``model.data_parallel_coordinates()`` where the model has it (model-parallel strategies:
    ranks of one pipeline or tensor group share a slice); else every rank is its own replica."""
    if hasattr(model, "data_parallel_coordinates"):
        return model.data_parallel_coordinates()
    return backend.world_size, backend.rank


def model_validation_loss(model: Any, inputs: torch.Tensor, targets: torch.Tensor,
                          loss_fn: LossFn) -> torch.Tensor:
    """This slice's mean loss, on every rank: ``model.validation_loss(...)`` where the model has
    it (a pipeline's logits exist on its last stage only), else ``loss_fn(model(inputs), targets)``."""
    if hasattr(model, "validation_loss"):
        return model.validation_loss(inputs, targets, loss_fn)
    return loss_fn(model(inputs), targets)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy:
    """``build`` wraps the model; ``data_parallel(model, backend) -> (dp_size, dp_rank)`` says
    which slice of the global batch this rank trains on (ranks of one pipeline or tensor group
    share one); ``validation_loss(model, inputs, targets, loss_fn)`` is called on every rank and
    returns this data-parallel slice's mean loss."""

    help: str
    build: Build
    data_parallel: Callable[[Any, Any], tuple[int, int]] = model_data_parallel
    validation_loss: Callable[[Any, torch.Tensor, torch.Tensor, LossFn], torch.Tensor] = \
        model_validation_loss


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
