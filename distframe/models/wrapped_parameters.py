"""What a strategy fixed about the wrapped model's parameters when it wrapped it, checked at each
forward with gradients (no communication; a few microseconds: one attribute read per parameter,
no pass over data).

A strategy decides at wrapping which Parameter objects it trains and in which dtype: DDP's
gradient buckets (one per dtype, their buffers kept between steps), ZeRO-1/2's flat spaces that
the parameters become views of, ZeRO-3/FSDP's units that point the parameters at gathered storage
or at stand-ins. Three changes made afterwards were silently wrong or failed deep inside torch:
a parameter replaced (``net[2].weight = nn.Parameter(...)``: never trained, on every strategy),
its ``requires_grad`` changed, and the model converted (``model.float()``, ``.to(dtype)``:
torch's "assign a gradient with dtype" or "mat1 and mat2 must have the same dtype"). Each is a
ConfigError naming the parameter and the fix, raised alike on every rank that made the change,
before any collective. The data-parallel strategies and HybridShardedModel (and so
TensorParallelModel and PipelineParallelModel, each stage its own parameters) check it.
``parameter_usage``: what the strategy's gradient buckets do about wrapped parameters without a
gradient. Casts after wrapping that give parameters new storage: casts.py.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from distframe.errors import ConfigError
from distframe.models.parameter_usage import ParameterUsage
from distframe.models.replica_buffers import UsageThenBuffers
from distframe.precision import MixedPrecisionPolicy


@dataclasses.dataclass(frozen=True)
class _Wrapped:
    name: str
    param: nn.Parameter
    trainable: bool
    dtype: torch.dtype  # what the strategy holds it in (its compute dtype when trainable)


class WrappedParameters:
    """The parameters of ``module`` as a strategy wraps them; ``policy``: its mixed precision
    (trainable parameters are then held in ``policy.compute_dtype`` of their own: ZeRO-1/2's
    flat views, ZeRO-3/FSDP's gathered copies and stand-ins)."""

    def __init__(self, module: nn.Module, policy: MixedPrecisionPolicy | None,
                 names: list[str] | None = None) -> None:
        """``names``: what to call the parameters, in ``module.parameters()`` order (a model-parallel
        stage's parameters by their names in the whole model); their own names by default."""
        policy = policy or MixedPrecisionPolicy()
        named = list(module.named_parameters())
        self._entries = [_Wrapped(n, p, p.requires_grad, policy.compute_dtype(p.dtype) if p.requires_grad
                                  else p.dtype) for n, (_, p) in zip(names or [n for n, _ in named], named)]
        self.record_versions()

    def record_versions(self) -> None:
        """Takes each parameter's ``_version`` (its count of in-place writes) as the one ``edited``
        compares with."""
        self._versions = [e.param._version for e in self._entries]

    def edited(self) -> list[nn.Parameter]:
        """The trainable parameters written in place since ``record_versions`` (one attribute read
        each; see [Note: in-place edits after wrapping] in master_weights.py)."""
        return [e.param for e, version in zip(self._entries, self._versions)
                if e.trainable and e.param._version != version]

    def check(self, model: nn.Module) -> None:
        """ConfigError when ``model.wrapped_model``'s parameters are not the ones wrapped, as
        they were (see the module docstring)."""
        strategy = type(model).__name__
        now = list(model.wrapped_model.named_parameters())
        if len(now) != len(self._entries):
            wrapped = {e.name for e in self._entries}
            added = [n for n, _ in now if n not in wrapped]
            removed = sorted(wrapped - {n for n, _ in now})
            which = (f"{added[0]!r} was added" if added else f"{removed[0]!r} was removed" if removed
                     else "a shared parameter was tied or untied")
            raise ConfigError(
                f"the model has {len(now)} parameters but had {len(self._entries)} when {strategy} "
                f"wrapped it ({which} since): the strategy trains those it wrapped (its gradient "
                "buckets and shards); build the whole model before wrapping")
        for entry, (_, param) in zip(self._entries, now):
            name = entry.name
            if param is not entry.param:
                raise ConfigError(
                    f"parameter {name!r} was replaced after {strategy} wrapped the model (a new "
                    "nn.Parameter assigned to the module); the strategy trains the one it wrapped (its "
                    "gradient hooks and shards), so the new one would never be trained: assign "
                    "parameters before wrapping; to change values use summon_full_parameters() or "
                    "load_state_dict()")
            if param.requires_grad != entry.trainable:
                raise trainable_changed(strategy, name, entry.trainable, param.requires_grad)
            if entry.trainable and param.dtype != entry.dtype:
                raise ConfigError(
                    f"parameter {name!r} is {param.dtype}, but {strategy} holds it in {entry.dtype}: the "
                    "model's dtype was changed after wrapping (model.float(), .double(), .half(), "
                    ".to(dtype)), which the strategy's buckets and shards, laid out at wrapping, "
                    "cannot follow; convert the model before wrapping it, or for lower-precision "
                    "compute keep it as it is and pass mixed_precision=MixedPrecisionPolicy("
                    "param_dtype=...) (ZeRO and FSDP; torch.autocast for DDP). (A tensor of another "
                    "dtype assigned to its .data: copy the values in instead, p.copy_(tensor) under "
                    "torch.no_grad())")


def trainable_changed(strategy: str, name: str, was: bool, now: bool) -> ConfigError:
    """The error for a parameter whose ``requires_grad`` changed after wrapping."""
    return ConfigError(
        f"parameter {name!r} was {'trainable' if was else 'frozen'} when {strategy} wrapped the model "
        f"and now has requires_grad={now}; the strategy decided at wrapping which parameters it "
        "trains (its gradient buckets and shards), so set requires_grad before wrapping (to freeze "
        "or unfreeze during training, wrap the model again)")


def parameter_usage(model: Any, names: list[str], params: list[nn.Parameter]) -> ParameterUsage:
    """What ``model``'s (a ShardedModelBase's) gradient buckets record and do about the wrapped
    parameters ``params`` that get no gradient, with the fix its warning offers."""
    strategy = type(model).__name__
    if model.skips_unused_parameters:
        fix = ("Pass find_unused_parameters=True (one small all_reduce per step) to leave "
               ".grad None for them, as torch DDP does.")
    else:
        fix = (f"{strategy}'s flat shards cannot skip one parameter; "
               f"{model.skipping_alternative} with find_unused_parameters=True trains it as one process")
    return UsageThenBuffers(names, params, model.backend, owner=strategy, fix=fix,
                            find_unused=model.config.find_unused_parameters,
                            then=model._replica_buffers.after_step)
