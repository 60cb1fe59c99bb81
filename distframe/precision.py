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
    ``master_dtype``: dtype of the sharded master weights the optimizer updates."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    master_dtype: torch.dtype = torch.float32

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
        """The dtype of master weights: ``master_dtype`` when the policy lowers precision,
        else the model's own dtype (float64 models stay float64)."""
        return self.master_dtype if self.param_dtype is not None else original

    @property
    def enabled(self) -> bool:
        return self.param_dtype is not None or self.reduce_dtype is not None
