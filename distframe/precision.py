"""MixedPrecisionPolicy: the dtypes that sharded strategies compute and communicate in.

Master weights and optimizer state stay in float32 (the dtype of the shards the optimizer
sees); ``param_dtype`` is what forward and backward run in, ``reduce_dtype`` what gradients are
reduced in. A policy with both fields ``None`` changes nothing. ZeRO-1/2/3 and FSDP take one;
DDP and the model-parallel models refuse it (``refuse_policy``): use torch.autocast there.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_map

from distframe.errors import ConfigError

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """``param_dtype``: dtype of the gathered (compute) parameters and of their gradients;
    ``reduce_dtype``: dtype gradients are averaged in (defaults to ``param_dtype``).
    ``master_dtype``: dtype of the sharded master weights the optimizer updates when
    ``param_dtype`` is set; by default (None) the model's own dtype, but at least float32 (fp16 or
    bf16 models get float32 masters; float64 models keep float64, as FSDP2 keeps the original
    dtype). A dtype given is taken as it is (bfloat16 masters to save memory).
    ``cast_forward_inputs``: with a ``param_dtype``, the floating-point tensors among the model's
    forward arguments (in tuples, lists, dicts, namedtuples and dataclasses, at any depth) are cast
    to it, as FSDP2's policy does by default; integer and bool tensors are left alone."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    master_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "master_dtype"):
            value = getattr(self, field)
            if value is not None and value not in _FLOATING:
                raise ConfigError(
                    f"MixedPrecisionPolicy.{field}={value!r} is not a floating dtype; use one of "
                    "torch.float16, torch.bfloat16, torch.float32 or torch.float64")
        if not isinstance(self.cast_forward_inputs, bool):
            raise ConfigError(f"MixedPrecisionPolicy.cast_forward_inputs={self.cast_forward_inputs!r}: "
                              "use True (cast floating inputs to param_dtype) or False")

    def compute_dtype(self, original: torch.dtype) -> torch.dtype:
        """The dtype parameters are gathered and used in."""
        return self.param_dtype or original

    def communication_dtype(self, original: torch.dtype) -> torch.dtype:
        """The dtype gradients are reduced in."""
        return self.reduce_dtype or self.param_dtype or original

    def master(self, original: torch.dtype) -> torch.dtype:
        """The dtype of master weights of a model in ``original``: the model's own without a
        ``param_dtype``; with one, ``master_dtype`` if given, else ``original`` promoted to at
        least float32. (The masters were float32 whenever ``param_dtype`` was set, so a float64
        model's fell to float32.)"""
        if self.param_dtype is None:
            return original
        return self.master_dtype or torch.promote_types(original, torch.float32)

    @property
    def enabled(self) -> bool:
        return self.param_dtype is not None or self.reduce_dtype is not None

    @property
    def input_dtype(self) -> torch.dtype | None:
        """The dtype floating forward inputs are cast to; None: they are left as they are."""
        return self.param_dtype if self.cast_forward_inputs else None


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with each floating-point tensor in it cast to ``dtype`` (differentiably; others,
    and tensors already in ``dtype``, as they are): in torch's pytree containers and in the fields of
    dataclasses (a copy of the dataclass, when a field changed), at any depth."""
    def cast(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.to(dtype) if leaf.is_floating_point() and leaf.dtype != dtype else leaf
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            fields = {f.name: getattr(leaf, f.name) for f in dataclasses.fields(leaf)}
            changed = {n: cast_floating(v, dtype) for n, v in fields.items()}
            if all(changed[n] is v for n, v in fields.items()):
                return leaf
            leaf = copy.copy(leaf)
            for name, v in changed.items():
                object.__setattr__(leaf, name, v)  # also through a frozen dataclass
        return leaf
    return tree_map(cast, value)


#: What a model-parallel model given a policy should do instead (see ``refuse_policy``).
MODEL_PARALLEL_FIX = ("for model parallelism compute in lower precision under torch.autocast (the weights "
                      "stay in their dtype, HybridShardedModel's ZeRO shards too), or train with ZeRO1Model, "
                      "ZeRO2Model, ZeRO3Model or FSDPModel to use a MixedPrecisionPolicy")


def refuse_policy(policy: MixedPrecisionPolicy | None, strategy: str, fix: str = MODEL_PARALLEL_FIX) -> None:
    """ConfigError naming ``strategy`` when it is given a ``policy``, which it would ignore."""
    if policy is not None:
        raise ConfigError(f"ShardingConfig.mixed_precision applies to ZeRO and FSDP (fp32 master weights), "
                          f"not {strategy}; {fix}")


def finer(dtype: torch.dtype | None, than: torch.dtype | None) -> bool:
    """Whether floating-point ``dtype`` holds more precision than ``than`` (float32 than bfloat16)."""
    return (dtype is not None and than is not None and dtype.is_floating_point and than.is_floating_point
            and torch.finfo(dtype).eps < torch.finfo(than).eps)
