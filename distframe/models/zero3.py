"""ZeRO3Model: every module's own parameters sharded and gathered around its forward and backward."""
from __future__ import annotations

from torch import nn

from distframe.errors import ConfigError
from distframe.models.config import ShardingConfig
from distframe.models.unit_model import (UnitShardedModelBase, UnitSpec, check_units_cover,
                                         parameter_homes)


class ZeRO3Model(UnitShardedModelBase):
    """ZeRO stage 3. A unit per module that registers trainable parameters itself (its direct
    parameters, flattened, padded to a multiple of N and split so rank r holds chunk r).

    Collectives per step: each unit's chunk is all-gathered just before the module's forward
    (the next module's gather is prefetched asynchronously), freed after it, all-gathered again
    before its backward, and its gradients are reduce-scattered (AVG) as soon as they are
    accumulated: 3(N-1)/N x parameters on the wire. Modules with fewer than
    ``replicate_below_numel`` parameters stay gathered between steps (gathered once per step, by
    the optimizer's step, so their parameters hold the current weights between steps).
    Each rank holds 16/N bytes per parameter for float32 Adam, plus the unit being used.

    A parameter must be used inside the forward of the modules that register it (or of their
    common ancestor): one used where its unit is not gathered (an nn.Sequential whose children
    are called one by one, so its own forward never runs) is a ConfigError naming the unit.
    """

    optimizer_name = "ZeRO3Optimizer"

    def _unit_fix(self, name: str) -> str:
        return ("use FSDPModel with an auto_wrap_policy that returns False for it (ZeRO3Model makes a "
                "unit of every module that registers parameters and of the lowest common ancestor of "
                "modules that share one; FSDP's units can be the submodules that run)")

    def _shared_unit_fix(self, unit_name: str) -> str:
        return ("register it on every module that uses it and call those modules (a head tied to an "
                "embedding: head.weight = emb.weight, then self.head(h)), and ZeRO3Model makes it one unit "
                "with their common ancestor, gathered around that ancestor's whole forward")

    def _check_config(self, config: ShardingConfig) -> None:
        if config.auto_wrap_policy is not None:
            raise ConfigError("ShardingConfig.auto_wrap_policy applies to FSDPModel; ZeRO3Model "
                              "makes one unit per module (use FSDPModel to choose units)")

    def _choose_units(self, module: nn.Module) -> list[UnitSpec]:
        homes = parameter_homes(module)
        by_home: dict[str, list[tuple[str, nn.Parameter]]] = {}
        for name, p in module.named_parameters():
            if p.requires_grad:
                by_home.setdefault(homes[id(p)], []).append((name, p))
        # In module order (parents first); a module reachable under two names is one unit.
        units: dict[int, UnitSpec] = {}
        for prefix, sub in module.named_modules(remove_duplicate=False):
            if prefix in by_home:
                units.setdefault(id(sub), (sub, []))[1].extend(by_home[prefix])
        chosen = list(units.values())
        check_units_cover(chosen, module, type(self).__name__)
        return chosen
