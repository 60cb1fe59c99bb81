"""FSDPModel: flat-parameter units chosen by an auto-wrap policy, sharded across ranks."""
from __future__ import annotations

from torch import nn

from distframe.models.unit_model import (NEVER_CALLED, UnitShardedModelBase, UnitSpec,
                                         check_units_cover, is_within, parameter_homes)


class FSDPModel(UnitShardedModelBase):
    """Fully sharded data parallel over flat-parameter units.

    Units (top-down): each submodule for which ``auto_wrap_policy(module, name)`` is true, or, by
    default, each submodule holding at least ``auto_wrap_min_params`` parameters (for a
    transformer: each block, the embedding, the head); a unit is not split further, containers
    that are never called (ModuleList, ModuleDict) are looked into, the root unit takes the rest.
    A parameter several modules share (tied weights) belongs to the innermost unit that holds
    all of them (see [Note: shared parameters] in unit_model.py), whatever the policy says.
    A unit is gathered by its module's forward: one whose forward does not run (an nn.Sequential
    whose children are called one by one) is a ConfigError at the first step that names it.
    Collectives per step: per unit, an all_gather before its forward (the next unit prefetched),
    freed after forward when ``reshard_after_forward`` (then gathered again before its backward),
    and one reduce_scatter(AVG) of its gradients once they are all accumulated. Each rank holds
    its chunk of every unit (master, gradient, optimizer state: 16/N bytes per parameter for
    float32 Adam) plus the gathered unit(s) in use.
    """

    optimizer_name = "FSDPOptimizer"

    def _unit_fix(self, name: str) -> str:
        return (f"give an auto_wrap_policy that returns False for '{name}' and wraps the submodules that "
                f"run instead (such as policy(module, name) -> name.startswith('{name}.'))")

    def _shared_unit_fix(self, unit_name: str) -> str:
        return ("register it on every module that uses it and call those modules (a head tied to an "
                "embedding: head.weight = emb.weight, then self.head(h)), and FSDPModel puts it in the unit "
                f"holding all of them; or give an auto_wrap_policy that returns False for '{unit_name}', so "
                "an enclosing unit (gathered for all of its forward) holds its parameters")

    def _choose_units(self, module: nn.Module) -> list[UnitSpec]:
        names = {id(p): n for n, p in module.named_parameters()}
        homes = parameter_homes(module)
        taken: set[int] = set()
        units: list[UnitSpec] = []

        def trainable(sub: nn.Module, name: str) -> list[tuple[str, nn.Parameter]]:
            # Only parameters whose every user is inside ``sub`` (shared ones may not be).
            return [(names[id(p)], p) for p in sub.parameters()
                    if p.requires_grad and id(p) not in taken and is_within(homes[id(p)], name)]

        def wants_unit(sub: nn.Module, name: str) -> bool:
            if self.config.auto_wrap_policy is not None:
                return bool(self.config.auto_wrap_policy(sub, name))
            return sum(p.numel() for _, p in trainable(sub, name)) >= self.config.auto_wrap_min_params

        def visit(sub: nn.Module, name: str) -> None:
            # Top-down: a child that qualifies becomes a unit and is not split further; a
            # container that is never called (ModuleList, ModuleDict) is looked into instead.
            for child_name, child in sub.named_children():
                qualified = f"{name}.{child_name}" if name else child_name
                if isinstance(child, NEVER_CALLED) or not wants_unit(child, qualified):
                    visit(child, qualified)
                elif params := trainable(child, qualified):
                    taken.update(id(p) for _, p in params)
                    units.append((child, params))

        visit(module, "")
        rest = trainable(module, "")
        if rest:
            units.append((module, rest))
        check_units_cover(units, module, type(self).__name__)
        return units
