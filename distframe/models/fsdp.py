"""FSDPModel: flat-parameter units chosen by an auto-wrap policy, sharded across ranks."""
from __future__ import annotations

from torch import nn

from distframe.models.unit_model import UnitShardedModelBase, UnitSpec, check_units_cover


class FSDPModel(UnitShardedModelBase):
    """Fully sharded data parallel over flat-parameter units.

    Units (bottom-up): each submodule for which ``auto_wrap_policy(module, name)`` is true, or,
    by default, each submodule whose parameters not already in a unit number at least
    ``auto_wrap_min_params`` (for a transformer: each block); the root unit takes the rest.
    Collectives per step: per unit, an all_gather before its forward (the next unit prefetched),
    freed after forward when ``reshard_after_forward`` (then gathered again before its backward),
    and one reduce_scatter(AVG) of its gradients once they are all accumulated. Each rank holds
    its chunk of every unit (master, gradient, optimizer state: 16/N bytes per parameter for
    float32 Adam) plus the gathered unit(s) in use.
    """

    optimizer_name = "FSDPOptimizer"

    def _choose_units(self, module: nn.Module) -> list[UnitSpec]:
        names = {id(p): n for n, p in module.named_parameters()}
        taken: set[int] = set()
        units: list[UnitSpec] = []

        def free_params(sub: nn.Module) -> list[tuple[str, nn.Parameter]]:
            return [(names[id(p)], p) for p in sub.parameters()
                    if p.requires_grad and id(p) not in taken and id(p) in names]

        def wants_unit(sub: nn.Module, name: str) -> bool:
            if self.config.auto_wrap_policy is not None:
                return bool(self.config.auto_wrap_policy(sub, name))
            return sum(p.numel() for _, p in free_params(sub)) >= self.config.auto_wrap_min_params

        def visit(sub: nn.Module, name: str) -> None:
            for child_name, child in sub.named_children():
                visit(child, f"{name}.{child_name}" if name else child_name)
            if sub is not module and wants_unit(sub, name):
                params = free_params(sub)
                if params:
                    taken.update(id(p) for _, p in params)
                    units.append((sub, params))

        visit(module, "")
        rest = free_params(module)
        if rest:
            units.append((module, rest))
        check_units_cover(units, module, type(self).__name__)
        return units
