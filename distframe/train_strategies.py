"""What ``--strategy``, ``--base-optimizer`` and ``--optimizer`` may name: small tables the
trainer reads.

A strategy entry wraps the single-device model (``wrap``) and builds the optimizer that belongs
with it (``optimizer``); to add one write those two functions and add a line to ``STRATEGIES``.
``--base-optimizer`` names the torch.optim class every strategy wraps (``BASE_OPTIMIZERS``).
``--optimizer`` (``OPTIMIZERS``) replaces the strategy's optimizer with one of
``distframe.optimizers.make_optimizer``'s (compressed, async, elastic); ``none`` keeps it.
Which data-parallel slice a rank trains on and how it computes the validation loss come from the
wrapped model's ``data_parallel_coordinates()`` and ``validation_loss()`` when it has them
(model-parallel strategies), or from the entry. Imports of the strategies happen inside the
functions, so ``distframe --help`` stays fast.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# wrap(module, backend, config) -> wrapped model (config: a TrainConfig)
Wrap = Callable[[nn.Module, Any, Any], Any]
# optimizer(model, optimizer_cls, optimizer_kwargs) -> the optimizer that belongs with the model
BuildOptimizer = Callable[[Any, type, dict], Any]


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
    """``wrap`` wraps the model; ``optimizer`` builds its optimizer; ``data_parallel(model,
    backend) -> (dp_size, dp_rank)`` says which slice of the global batch this rank trains on
    (ranks of one pipeline or tensor group share one); ``validation_loss(model, inputs, targets,
    loss_fn)`` is called on every rank and returns this data-parallel slice's mean loss.
    ``model_parallel``: the strategy splits the model (``--dp/--tp/--pp`` apply to it)."""

    help: str
    wrap: Wrap
    optimizer: BuildOptimizer
    model_parallel: bool = False
    data_parallel: Callable[[Any, Any], tuple[int, int]] = model_data_parallel
    validation_loss: Callable[[Any, torch.Tensor, torch.Tensor, LossFn], torch.Tensor] = \
        model_validation_loss


def _data_parallel(model_class: str) -> Wrap:
    """Wraps with ``distframe.models.<model_class>``, imported on first use."""
    def wrap(module: nn.Module, backend: Any, config: Any) -> Any:
        import distframe.models
        return getattr(distframe.models, model_class)(module, backend)
    return wrap


def _sharded_optimizer(optimizer_class: str) -> BuildOptimizer:
    """Builds ``distframe.optimizers.<optimizer_class>(model, optimizer_cls, **kwargs)``."""
    def build(model: Any, optimizer_cls: type, kwargs: dict) -> Any:
        import distframe.optimizers
        return getattr(distframe.optimizers, optimizer_class)(model, optimizer_cls, **kwargs)
    return build


def _model_parallel(strategy: str) -> Wrap:
    def wrap(module: nn.Module, backend: Any, config: Any) -> Any:
        from distframe.models import build_model_parallel
        from distframe.train_rng import dropout_seed
        return build_model_parallel(strategy, module, backend, dp=config.dp, tp=config.tp,
                                    pp=config.pp, cp=config.cp, micro_batches=config.micro_batches,
                                    schedule=config.schedule, virtual_stages=config.virtual_stages,
                                    dropout_seed=dropout_seed(config.seed))
    return wrap


def plain_optimizer(model: Any, optimizer: Any, kwargs: dict) -> Any:
    """A torch.optim optimizer over ``model.parameters()``: ``optimizer`` itself when it is an
    instance already built over them (``base_optimizer``'s groups), else the class with ``kwargs``.
    Model-parallel models synchronise their own gradients: one over this rank's parameters (its
    stage, its tensor shards) is all they need."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    return optimizer(model.parameters(), **kwargs)


STRATEGIES: dict[str, Strategy] = {
    "ddp": Strategy(help="replicated parameters and optimizer state, gradients all-reduced",
                    wrap=_data_parallel("DDPModel"), optimizer=_sharded_optimizer("DDPOptimizer")),
    "zero1": Strategy(help="optimizer state sharded", wrap=_data_parallel("ZeRO1Model"),
                      optimizer=_sharded_optimizer("ZeRO1Optimizer")),
    "zero2": Strategy(help="optimizer state and gradients sharded", wrap=_data_parallel("ZeRO2Model"),
                      optimizer=_sharded_optimizer("ZeRO2Optimizer")),
    "zero3": Strategy(help="parameters, gradients and optimizer state sharded per module",
                      wrap=_data_parallel("ZeRO3Model"), optimizer=_sharded_optimizer("ZeRO3Optimizer")),
    "fsdp": Strategy(help="flat parameter shards per wrapped unit", wrap=_data_parallel("FSDPModel"),
                     optimizer=_sharded_optimizer("FSDPOptimizer")),
    "pipeline": Strategy(help="layers split into --pp stages, --micro-batches per step",
                         wrap=_model_parallel("pipeline"), optimizer=plain_optimizer,
                         model_parallel=True),
    "tensor": Strategy(help="attention heads and MLP split over --tp ranks",
                       wrap=_model_parallel("tensor"), optimizer=plain_optimizer,
                       model_parallel=True),
    "hybrid": Strategy(help="--dp x --tp x --pp", wrap=_model_parallel("hybrid"),
                       optimizer=plain_optimizer, model_parallel=True),
}


def _adamw_settings(lr: float, weight_decay: float) -> dict[str, Any]:
    return {"lr": lr, "weight_decay": weight_decay, "betas": (0.9, 0.95)}


def _sgd_settings(lr: float, weight_decay: float) -> dict[str, Any]:
    return {"lr": lr, "weight_decay": weight_decay, "momentum": 0.9}


# name -> (torch.optim class, settings(lr, weight_decay) -> keyword arguments)
BASE_OPTIMIZERS: dict[str, tuple[type, Callable[[float, float], dict[str, Any]]]] = {
    "adamw": (torch.optim.AdamW, _adamw_settings),
    "sgd": (torch.optim.SGD, _sgd_settings),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerChoice:
    """An ``--optimizer`` entry: ``strategies`` it runs on (None: the strategy's own optimizer,
    any strategy) and ``settings`` its flags (TrainConfig fields, checked to be left at their
    defaults under any other --optimizer)."""

    help: str
    strategies: tuple[str, ...] | None
    settings: tuple[str, ...] = ()


DATA_PARALLEL_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")

OPTIMIZERS: dict[str, OptimizerChoice] = {
    "none": OptimizerChoice(help="the strategy's own optimizer", strategies=None),
    "compressed": OptimizerChoice(
        help="DDP with compressed gradient exchange (--compressor)", strategies=("ddp",),
        settings=("compressor", "topk_ratio", "powersgd_rank", "powersgd_start")),
    "async": OptimizerChoice(
        help="parameter server on rank 0, the other ranks train asynchronously "
             "(--max-staleness)", strategies=("ddp",), settings=("max_staleness", "round_robin")),
    "elastic": OptimizerChoice(
        help="in-memory demo: workers leave, join (--elastic-schedule) and fail (--fail-at) "
             "during the run", strategies=DATA_PARALLEL_STRATEGIES,
        settings=("commit_every", "elastic_schedule", "fail_at")),
}


def compressed_settings(config: Any) -> dict[str, Any]:
    """make_optimizer("compressed", ...) keywords for ``config``'s compressor flags."""
    settings: dict[str, Any] = {"compressor": config.compressor}
    if config.compressor == "topk":
        settings["ratio"] = config.topk_ratio
    elif config.compressor == "int8":
        settings["seed"] = config.seed
    elif config.compressor == "powersgd":
        settings.update(rank=config.powersgd_rank, start_iter=config.powersgd_start,
                        seed=config.seed)
    return settings
