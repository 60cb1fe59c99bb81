"""ShardingConfig (the settings every data-parallel strategy reads) and TrainingState."""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

from torch import nn

from distframe.errors import ConfigError
from distframe.precision import MixedPrecisionPolicy


class TrainingState(enum.Enum):
    """Where a wrapped model (or one sharded unit of it) is in its step, FSDP2's vocabulary."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    """Settings of a data-parallel strategy; each strategy reads the fields that apply to it.

    bucket_cap_mb / first_bucket_cap_mb: gradient bucket sizes (DDP, ZeRO-1, ZeRO-2); the first
        bucket (the last parameters registered, whose gradients are ready first) is smaller so
        communication starts early in backward.
    mixed_precision: compute and reduce dtypes with float32 master weights (ZeRO and FSDP).
    reshard_after_forward: free gathered parameters after each unit's forward and gather them
        again for backward (ZeRO-3, FSDP); False keeps them until the unit's backward is done.
    prefetch: gather the next unit (forward order, then reverse for backward) asynchronously.
    auto_wrap_min_params: FSDP makes a unit of each submodule holding at least this many
        parameters not already in a smaller unit (for a transformer: each block).
    auto_wrap_policy: ``policy(module, qualified_name) -> bool`` replacing the size rule.
    replicate_below_numel: ZeRO-3 keeps modules with fewer parameters than this gathered between
        steps (their master weights, gradients and optimizer state stay sharded).
    check_structure: compare parameter names, shapes and dtypes across ranks at construction
        (ZeRO-3 and FSDP: and the order their units ran in the first forward with grad).
    broadcast_buffers: as torch DDP, every rank computes with rank 0's buffers (BatchNorm's
        running statistics) after each step: they are sent at the end of each gradient
        synchronisation and take effect at the next forward, so an evaluation after a step
        agrees on every rank and sends nothing (rank 0 may evaluate alone); a forward that will
        synchronise after another training forward (no backward between, no_sync) broadcasts
        them first, as does ``gather_full_parameters()`` ([Note: buffers after a step] in
        replica_buffers.py). False keeps each rank's own.
    find_unused_parameters: torch DDP's setting, for DDPModel and HybridShardedModel with
        data_parallel="ddp": a parameter that no rank gave a gradient keeps ``.grad = None``
        after synchronisation, so the optimizer skips it as it would in one process (one small
        all_reduce per synchronisation; see ParameterUsage). False averages it as zeros (and
        every data-parallel model warns once on a rank that sees one).
    """

    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    mixed_precision: MixedPrecisionPolicy | None = None
    reshard_after_forward: bool = True
    prefetch: bool = True
    auto_wrap_min_params: int = 100_000
    auto_wrap_policy: Callable[[nn.Module, str], bool] | None = None
    replicate_below_numel: int = 0
    check_structure: bool = True
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False

    def __post_init__(self) -> None:
        for field in ("bucket_cap_mb", "first_bucket_cap_mb"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"ShardingConfig.{field}={value!r}: use a positive number of "
                                  "megabytes (the default is 25 for bucket_cap_mb, 1 for the first)")
        for field in ("auto_wrap_min_params", "replicate_below_numel"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"ShardingConfig.{field}={value!r}: use a non-negative int")
        if self.mixed_precision is not None and not isinstance(self.mixed_precision, MixedPrecisionPolicy):
            raise ConfigError(
                f"ShardingConfig.mixed_precision={self.mixed_precision!r}: pass "
                "distframe.precision.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...) or None")
        if self.auto_wrap_policy is not None and not callable(self.auto_wrap_policy):
            raise ConfigError("ShardingConfig.auto_wrap_policy must be callable as "
                              "policy(module, qualified_name) -> bool, or None for the size rule")
        for field in ("reshard_after_forward", "prefetch", "check_structure", "broadcast_buffers",
                      "find_unused_parameters"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(f"ShardingConfig.{field} must be True or False")

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * 2**20)

    @property
    def first_bucket_cap_bytes(self) -> int:
        return int(min(self.first_bucket_cap_mb, self.bucket_cap_mb) * 2**20)


def resolve_config(config: ShardingConfig | None, overrides: dict) -> ShardingConfig:
    """``config`` with keyword ``overrides`` applied; an unknown keyword is a ConfigError."""
    if config is not None and not isinstance(config, ShardingConfig):
        raise ConfigError(f"config must be a ShardingConfig, got {type(config).__name__}")
    known = {f.name for f in dataclasses.fields(ShardingConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}; ShardingConfig fields are {sorted(known)}")
    base = config or ShardingConfig()
    return dataclasses.replace(base, **overrides) if overrides else base
