"""ZeRO3Model: every module's own parameters sharded and gathered around its forward and backward."""
from __future__ import annotations

from torch import nn

from distframe.errors import ConfigError
from distframe.models.config import ShardingConfig
from distframe.models.unit_model import UnitShardedModelBase, UnitSpec, check_units_cover


class ZeRO3Model(UnitShardedModelBase):
    """ZeRO stage 3. A unit per module that registers trainable parameters itself (its direct
    parameters, flattened, padded to a multiple of N and split so rank r holds chunk r).

    Collectives per step: each unit's chunk is all-gathered just before the module's forward
    (the next module's gather is prefetched asynchronously), freed after it, all-gathered again
    before its backward, and its gradients are reduce-scattered (AVG) as soon as they are
    accumulated: 3(N-1)/N x parameters on the wire. Modules with fewer than
    ``replicate_below_numel`` parameters stay gathered between steps (gathered once per step).
    Each rank holds 16/N bytes per parameter for float32 Adam, plus the unit being used.

    A parameter must be used inside the forward of the module that registers it (for shared
    weights used elsewhere, use FSDPModel with a policy wrapping their common parent).
    """

    optimizer_name = "ZeRO3Optimizer"

    def _check_config(self, config: ShardingConfig) -> None:
        if config.auto_wrap_policy is not None:
            raise ConfigError("ShardingConfig.auto_wrap_policy applies to FSDPModel; ZeRO3Model "
                              "makes one unit per module (use FSDPModel to choose units)")

    def _choose_units(self, module: nn.Module) -> list[UnitSpec]:
        units: list[UnitSpec] = []
        seen: set[int] = set()
        for prefix, sub in module.named_modules():
            params = []
            for name, p in sub.named_parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append((f"{prefix}.{name}" if prefix else name, p))
            if params:
                units.append((sub, params))
        check_units_cover(units, module, type(self).__name__)
        return units
