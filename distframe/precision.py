"""MixedPrecisionPolicy: the dtypes that sharded strategies compute and communicate in.

Master weights and optimizer state stay in float32 (the dtype of the shards the optimizer
sees); ``param_dtype`` is what forward and backward run in, ``reduce_dtype`` what gradients are
reduced in. A policy with both fields ``None`` changes nothing.
"""
from __future__ import annotations

import dataclasses

import torch

from distframe.errors import ConfigError

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """``param_dtype``: dtype of the gathered (compute) parameters and of their gradients;
    ``reduce_dtype``: dtype gradients are averaged in (defaults to ``param_dtype``).
    ``master_dtype``: dtype of the sharded master weights the optimizer updates when
    ``param_dtype`` is set; by default (None) the model's own dtype, but at least float32 (fp16 or
    bf16 models get float32 masters; float64 models keep float64, as FSDP2 keeps the original
    dtype). A dtype given is taken as it is (bfloat16 masters to save memory)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    master_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "master_dtype"):
            value = getattr(self, field)
            if value is not None and value not in _FLOATING:
                raise ConfigError(
                    f"MixedPrecisionPolicy.{field}={value!r} is not a floating dtype; use one of "
                    "torch.float16, torch.bfloat16, torch.float32 or torch.float64")

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


def finer(dtype: torch.dtype | None, than: torch.dtype | None) -> bool:
    """Whether floating-point ``dtype`` holds more precision than ``than`` (float32 than bfloat16)."""
    return (dtype is not None and than is not None and dtype.is_floating_point and than.is_floating_point
            and torch.finfo(dtype).eps < torch.finfo(than).eps)
