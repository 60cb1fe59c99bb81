"""AttachedData: what ZeRO-1/2/3 and FSDP point their parameters' ``.data`` at, and a ``.data`` the
user replaced since (``p.data = tensor``), taken into the strategy's storage.

[Note: a replaced .data]
``p.data = tensor`` after wrapping (between steps: re-initialising a weight, swapping EMA weights
in for an evaluation and back, loading weights by hand) gives the Parameter other storage and
leaves the Parameter, its ``.grad``, its hooks and its ``_version`` as they are. DDP's parameters
are what its optimizer steps, so it trains on from the new values as one process does. ZeRO-1/2's
parameters are views of a flat buffer that the masters are views of (under a MixedPrecisionPolicy,
a copy of), and ZeRO-3/FSDP point them at gathered storage or at a NaN stand-in themselves: the
replaced one left the flat buffer (forward computed with the user's tensor, the optimizer stepped
the flat copy, whose all_gather never reached the parameter again), or the unit's next gather
overwrote it. So the strategy records the data pointer of each tensor it attaches (``attach``),
and where in-place edits are taken ([Note: in-place edits after wrapping] in master_weights.py,
and before a load) a parameter whose ``data_ptr()`` differs (one call per parameter, nothing else
where nothing changed) is taken as an edit is: its values go into this rank's master chunk (an
element that changed takes the new value, the others keep the master's precision) and into the
strategy's tensor where that holds values (the flat view, a gathered unit's view), with no
communication (every rank makes the same replacement); then ``.data`` points at the strategy's
tensor again, so later steps reach the parameter (which no longer aliases the tensor assigned).
Until taken the replacement stays: a unit's gather and reshard attach their tensors to the other
parameters only, so a forward under ``torch.no_grad()``, which takes nothing, computes with it.
The EMA swap (``saved = p.data; p.data = ema``, an evaluation under no_grad, ``p.data = saved``)
thus evaluates the EMA weights and trains on exactly. Evaluated with grad, the forward takes the
EMA weights into the masters, and ``saved`` (the strategy's tensor, or a stand-in) gives nothing
back: swap inside ``summon_full_parameters()`` then. Refused (ConfigError): a replacement of
another shape, dtype or device (the storage was laid out at wrapping), one holding NaN while its
unit holds stand-ins (computed from one: ``p.data = p.data * 0.5`` between uses), and a tie.

[Note: a tie made after wrapping] ``b.data = a.data`` (or a view of it) makes two parameters share
storage; one process's optimizer then steps both through it. The strategies lay each parameter's
storage out at wrapping (flat buffers, units, master chunks), so they cannot follow a tie made
since: taken as above, the values were copied and ``.data`` pointed back at b's own storage,
silently untying them; and under ZeRO-3/FSDP, where every resharded parameter of a dtype expanded
one shared NaN, the pointer did not even move, so nothing was taken and the next gather undid it
(the shape was not checked either). So each resharded parameter expands a NaN of its own
(sharded_unit.py: its pointer moves when it is given another's), and a replacement sharing
storage with what the strategy holds for the model (a flat buffer, a unit's gathered storage or
its NaNs, a master chunk: ``held_storages``) is refused, saying to tie before wrapping. Storages
are compared by their data pointer, which a freed one (a resharded unit's) has as 0: a view of
it is refused too, before its freed memory is read. Only where something was replaced does this
cost anything (one call per tensor the strategy attached).
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import torch

from distframe.errors import ConfigError
from distframe.models.flat import FlatSpace


class AttachedData:
    """The tensors a strategy points the parameters of ``space`` at (``p.data``), whose values this
    rank's ``master`` chunk of the space holds; see [Note: a replaced .data]."""

    def __init__(self, space: FlatSpace, master: torch.Tensor, *,
                 also_held: Sequence[torch.Tensor] = ()) -> None:
        """``also_held``: tensors whose storage the strategy holds for ``space`` besides those it
        attaches (a unit's gathered storage while it holds stand-ins, and its NaNs while gathered)."""
        self.space, self.master = space, master
        self.params = space.params
        self.tensors: list[torch.Tensor] = []
        self.pointers: list[int] = []
        self.holds_values = False
        self.also_held = list(also_held)

    def held_storages(self) -> set[int]:
        """The data pointers of the storages the strategy holds for the space (0: a freed one)."""
        return {t.untyped_storage().data_ptr() for t in (*self.tensors, *self.also_held, self.master)}

    def replaced(self) -> list[int]:
        """Positions of the parameters pointed elsewhere than ``attach`` pointed them."""
        now = [param.data_ptr() for param in self.params]
        if now == self.pointers:  # the usual case, compared in one call
            return []
        return [k for k, (pointer, attached) in enumerate(zip(now, self.pointers)) if pointer != attached]

    def attach(self, tensors: list[torch.Tensor], *, holds_values: bool, keep: Collection[int] = ()) -> None:
        """Points each parameter but those at ``keep`` (replaced, not yet taken) at its tensor;
        ``holds_values``: whether the tensors hold the parameters' values (not stand-ins)."""
        with torch.no_grad():
            for k, (param, tensor) in enumerate(zip(self.params, tensors)):
                if k not in keep:
                    param.data = tensor
        self.tensors, self.holds_values = tensors, holds_values
        self.pointers = [t.data_ptr() for t in tensors]

    def take_replaced(self, positions: list[int], rank: int, strategy: str,
                      held: Collection[int] | None = None) -> None:
        """Writes the parameters at ``positions`` (``replaced()``) into this rank's master chunk and,
        where they hold values, into the attached tensors, which the parameters point at again;
        local. Wait for gathers writing into the tensors first. ``held``: ``held_storages`` of the
        whole model (by default this space's), whose storage a replacement may not share."""
        held = self.held_storages() if held is None else held
        segments = {s.name: s for s in self.space.segments(rank)}  # one per parameter at most
        with torch.no_grad():
            for k in positions:
                name, param, tensor = self.space.entries[k].name, self.params[k], self.tensors[k]
                new = param.data
                check_not_tied(strategy, f"parameter {name!r}", new, held)
                check_replacement(strategy, f"parameter {name!r}", new, tensor)
                if not self.holds_values and bool(new.isnan().any()):
                    raise _computed_from_stand_in(strategy, name)
                seg = segments.get(name)
                if seg is not None:
                    values = new.reshape(-1)[seg.param_offset:seg.param_offset + seg.length]
                    chunk = self.master.detach()[seg.shard_offset:seg.shard_offset + seg.length]
                    chunk.copy_(torch.where(values != chunk.to(values.dtype), values.to(chunk.dtype), chunk))
                if self.holds_values:
                    tensor.copy_(new)
                param.data = tensor


def held_storages(attached: Iterable[AttachedData]) -> set[int]:
    """What every space of a model holds (``AttachedData.held_storages``)."""
    return set().union(*(data.held_storages() for data in attached))


def check_not_tied(strategy: str, what: str, new: torch.Tensor, held: Collection[int]) -> None:
    """ConfigError if ``new`` (a replaced ``.data`` of ``what``) shares one of the storages
    ``held`` (data pointers; see [Note: a tie made after wrapping])."""
    if not new.numel() or new.untyped_storage().data_ptr() not in held:  # no elements: none shared
        return
    raise ConfigError(
        f"{strategy}: {what} was given .data that shares storage with what the strategy holds for "
        "this model: another parameter's .data or a view of it (p.data = q.data after wrapping, "
        "which ties the two), or a NaN stand-in held while resharded. The strategy laid the "
        "parameters' storage out at wrapping and cannot follow a tie made since: tie them before "
        "wrapping (module.p = module.q); to copy the values, with torch.no_grad(): p.copy_(q) "
        "(where they are resharded, inside model.summon_full_parameters())")


def check_replacement(strategy: str, what: str, new: torch.Tensor, like: torch.Tensor) -> None:
    """ConfigError unless ``new`` (a replaced ``.data`` of ``what``) has ``like``'s shape, dtype
    and device."""
    if new.shape == like.shape and new.dtype == like.dtype and new.device == like.device:
        return
    raise ConfigError(
        f"{strategy}: {what} was given .data of shape {tuple(new.shape)}, {new.dtype} on {new.device} "
        f"(p.data = tensor after wrapping), but the strategy holds it as shape {tuple(like.shape)}, "
        f"{like.dtype} on {like.device}, in storage laid out at wrapping; to change its values, copy "
        "them in (with torch.no_grad(): p.copy_(tensor)) or assign .data inside "
        "model.summon_full_parameters(); to change its shape, dtype or device, do it before wrapping")


def _computed_from_stand_in(strategy: str, name: str) -> ConfigError:
    return ConfigError(
        f"{strategy}: parameter {name!r} was given .data holding NaN while its unit was resharded, "
        "when it holds a NaN stand-in, not the weights (p.data = p.data * 0.5 computes from that "
        "NaN); compute new weights from its values inside model.summon_full_parameters() (the same "
        "on every rank), where it holds them")
