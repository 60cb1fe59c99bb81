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
another shape, dtype or device (the storage was laid out at wrapping), and one holding NaN while
its unit holds stand-ins (computed from one: ``p.data = p.data * 0.5`` between uses).
"""
from __future__ import annotations

from collections.abc import Collection

import torch

from distframe.errors import ConfigError
from distframe.models.flat import FlatSpace


class AttachedData:
    """The tensors a strategy points the parameters of ``space`` at (``p.data``), whose values this
    rank's ``master`` chunk of the space holds; see [Note: a replaced .data]."""

    def __init__(self, space: FlatSpace, master: torch.Tensor) -> None:
        self.space, self.master = space, master
        self.params = space.params
        self.tensors: list[torch.Tensor] = []
        self.pointers: list[int] = []
        self.holds_values = False

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

    def take_replaced(self, positions: list[int], rank: int, strategy: str) -> None:
        """Writes the parameters at ``positions`` (``replaced()``) into this rank's master chunk and,
        where they hold values, into the attached tensors, which the parameters point at again;
        local. Wait for gathers writing into the tensors first."""
        segments = {s.name: s for s in self.space.segments(rank)}  # one per parameter at most
        with torch.no_grad():
            for k in positions:
                name, param, tensor = self.space.entries[k].name, self.params[k], self.tensors[k]
                new = param.data
                check_replacement(strategy, f"parameter {name!r}", new, tensor)
                if not self.holds_values and bool(new.isnan().any()):
                    raise _computed_from_stand_in(strategy, name)
                seg = segments.get(name)
                if seg is not None:
                    values = new.reshape(-1)[seg.param_offset:seg.param_offset + seg.length]
                    held = self.master.detach()[seg.shard_offset:seg.shard_offset + seg.length]
                    held.copy_(torch.where(values != held.to(values.dtype), values.to(held.dtype), held))
                if self.holds_values:
                    tensor.copy_(new)
                param.data = tensor


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
