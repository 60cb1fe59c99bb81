"""``zero_grad`` of what a wrapper took over (the module a sharded model wraps, the torch.optim
instance a sharded optimizer adopts) routed to the wrapper's own ``zero_grad``.

[Note: zero_grad of what the user still holds] Users keep references to the module they wrapped
and the optimizer instance they handed over, and clear gradients through them (``net.zero_grad()``,
``opt.zero_grad()``), as one process does. Under ZeRO-1/2/3 and FSDP neither reaches the gradients
that matter: the averaged ones live on the master chunks (and ZeRO-1's kept buckets, FSDP's
no_sync accumulations), and an adopted instance with several param groups holds only views of
them. The next step then added the old gradient again, with no error. So wrapping sets one
instance attribute, ``zero_grad``, on the object taken over: a ``ZeroGradRoute`` that calls the
owner's ``zero_grad`` (same ``set_to_none``). It falls back to the object's class method when the
owner is gone (it is held weakly: the route keeps no wrapper alive) and when the owner's own
``zero_grad`` calls it (no recursion); a closure that clears through it inside the owner's step is
routed too. A deep copy or an unpickled copy is not wrapped: its ``zero_grad`` is its class's.

A submodule's ``zero_grad`` (``net[1].zero_grad()``) is its class's where each parameter keeps its
own gradient (DDP: one process's result). Under ZeRO-1/2/3 and FSDP (and a hybrid model with
ZeRO) it cannot be honoured: clearing the views left the averaged gradients in the shards (the
result was 0.03 off one process after three Adam steps, with no error), and a flat shard is
stepped whole, so zeroing a part would still move those parameters through momentum and weight
decay where one process skips a parameter whose gradient is None. So it raises ConfigError.
"""
from __future__ import annotations

import copy
import weakref
from typing import Any

from distframe.errors import ConfigError


class ZeroGradRoute:
    """Stands in for ``target.zero_grad``: ``owner.zero_grad`` (see the note)."""

    def __init__(self, target: Any, owner: Any | None, submodule: str | None = None) -> None:
        self._target = target
        self._owner = None if owner is None else weakref.ref(owner)
        self._submodule = submodule  # the name of a submodule of the wrapped module
        self._inside = False

    def __call__(self, set_to_none: bool = True) -> None:
        owner = None if self._owner is None else self._owner()
        # skips_unused_parameters: the optimizer steps each parameter on its own gradient (DDP)
        own = self._submodule is not None and owner is not None and owner.skips_unused_parameters
        if owner is None or self._inside or own:
            type(self._target).zero_grad(self._target, set_to_none=set_to_none)
            return
        if self._submodule is not None:
            raise ConfigError(
                f"{self._submodule}.zero_grad() cannot clear only this submodule's gradients under "
                f"{type(owner).__name__}: they are averaged into flat shards that mix parameters and "
                "are stepped whole (zeros would still move the parameters through momentum and weight "
                "decay). Clear every gradient with model.zero_grad(), or keep the submodule out of "
                "training with requires_grad_(False) before wrapping")
        self._inside = True
        try:
            owner.zero_grad(set_to_none=set_to_none)
        finally:
            self._inside = False

    def __deepcopy__(self, memo: dict[int, Any]) -> ZeroGradRoute:
        return ZeroGradRoute(copy.deepcopy(self._target, memo), None)

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _unrouted, (self._target,)


def _unrouted(target: Any) -> ZeroGradRoute:
    return ZeroGradRoute(target, None)


def route_zero_grad(target: Any, owner: Any) -> None:
    """From now on ``target.zero_grad(...)`` is ``owner.zero_grad(...)`` (see the note)."""
    target.__dict__["zero_grad"] = ZeroGradRoute(target, owner)


def route_submodule_zero_grad(module: Any, owner: Any) -> None:
    """Every submodule of ``module``: its ``zero_grad`` refused where the owner shards gradients
    (see the note)."""
    for name, submodule in module.named_modules():
        if submodule is not module:
            submodule.__dict__["zero_grad"] = ZeroGradRoute(submodule, owner, name)
