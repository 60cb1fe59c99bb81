"""MasterWeightsModelBase: what ZeRO-1/2/3 and FSDP share as models whose optimizer steps master
weights (this rank's chunk of each flat space) rather than the parameters forward computes with:
floating forward inputs cast to ``param_dtype`` (``MixedPrecisionPolicy.cast_forward_inputs``, as
FSDP2 casts them), and in-place edits of those parameters written into the masters.

[Note: in-place edits after wrapping] Code that edits the wrapped model's parameters in place
(``model.module.apply(init_fn)`` after wrapping, a WGAN critic's ``p.clamp_()`` between steps, under
``torch.no_grad``) edits what forward computes with. DDP's parameters are what its optimizer steps,
and so are ZeRO-1/2's without a MixedPrecisionPolicy (the master chunk is a view of the flat
buffer the parameters are views of). ZeRO-1/2's masters under a policy are a copy in master_dtype,
and a ZeRO-3/FSDP unit kept gathered (``replicate_below_numel``) computes with a gathered copy of
its masters: the forward used the edit, the optimizer stepped the old masters, and the next gather
overwrote the edit. So each trainable parameter's ``_version`` (torch's count of the in-place writes
through it; the strategies write through ``.data`` and their flat buffers, which leave it alone) is
recorded at wrapping and after each edit taken (WrappedParameters). At each forward with grad,
each ``synchronize_gradients()`` (so before the optimizer steps), ``gather_full_parameters()``,
``state_dict()`` and on entering ``summon_full_parameters()``, a parameter whose version moved
has its values written into this rank's master chunk wherever they differ from the master in the
compute dtype: an element the edit changed takes the edited value (in the compute dtype: to edit
at master precision, edit inside summon_full_parameters()), the others keep the master's
precision (float64 masters under float32 compute are not rounded). No communication: every rank
makes the same edit (as inside summon_full_parameters()). Checking is one attribute read per
parameter; only an edited parameter's values are compared. A parameter of a unit that holds its
stand-in (resharded between uses; torch lets one write a one-element one) cannot take an edit,
which would be lost at the next gather: a ConfigError names it. Writes inside
summon_full_parameters() are its own (written back or dropped), not edits to take again.
A replaced ``.data`` (``p.data = tensor``) is taken at the same points, and before a load:
[Note: a replaced .data] in replaced_data.py.
Gap: a write in place through ``p.data`` (``p.data.mul_(2)``) moves no ``p._version`` (autograd does
not see it either) and no data pointer, so under a policy or in a unit kept gathered it is still
lost; write through the parameter under ``torch.no_grad()``, or inside summon_full_parameters().
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError
from distframe.models.base import ShardedModelBase
from distframe.models.config import ShardingConfig
from distframe.models.dp_modules import prepare_replicated_modules
from distframe.models.flat import FlatSpace
from distframe.models.replaced_data import AttachedData, held_storages
from distframe.models.sharded_state import ShardLayout
from distframe.precision import cast_floating

#: (a flat space, this rank's master chunk of it when that is not the parameters' own storage,
#: whether the parameters hold their values now rather than stand-ins)
MasterChunk = tuple[FlatSpace, torch.Tensor, bool]


class MasterWeightsModelBase(ShardedModelBase):
    """ShardedModelBase whose optimizer steps master chunks: see the module docstring."""

    #: The dtype floating forward inputs are cast to (a policy's ``input_dtype``); None: none.
    _input_dtype: torch.dtype | None = None

    def __init__(self, module: nn.Module, backend: ICommunicationBackend, *,
                 config: ShardingConfig | None = None, **settings: Any) -> None:
        super().__init__(module, backend, config=config, **settings)
        # SyncBatchNorm, max_norm: dp_modules.py. Before the subclasses' checks: a wrapper they
        # refuse is freed, and its SyncBatchNorms, which hold it weakly, run torch's forward again.
        prepare_replicated_modules(self, self.wrapped_model, backend)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """As ShardedModelBase's, with floating inputs cast to ``param_dtype`` under a policy that
        casts them (``MixedPrecisionPolicy.cast_forward_inputs``)."""
        if self._input_dtype is not None:
            args, kwargs = cast_floating((args, kwargs), self._input_dtype)
        return super().forward(*args, **kwargs)

    def _master_chunks(self) -> list[MasterChunk]:
        """The flat spaces whose master chunk is apart from the parameters (see ``MasterChunk``)."""
        raise NotImplementedError

    def _attached_data(self) -> list[AttachedData]:
        """What each flat space's parameters are pointed at (see [Note: a replaced .data])."""
        raise NotImplementedError

    def _finish_gathers(self) -> None:
        """Waits for gathers still writing into the parameters' storage (ZeRO-3/FSDP's prefetch)."""

    def _take_replaced_data(self) -> set[int]:
        """Takes each replaced ``.data`` (see [Note: a replaced .data] in replaced_data.py); local.
        The ids of the parameters taken."""
        if getattr(self, "_summoned", False):  # the block's parameters are its own: full_parameters.py
            return set()
        found = [(data, positions) for data in self._attached_data() if (positions := data.replaced())]
        if not found:
            return set()
        self._finish_gathers()
        held = held_storages(self._attached_data())  # see [Note: a tie made after wrapping]
        for data, positions in found:
            data.take_replaced(positions, self.backend.rank, type(self).__name__, held)
        return {id(data.params[k]) for data, positions in found for k in positions}

    def _take_in_place_edits(self) -> None:
        """Writes parameters edited in place, or given other ``.data``, into this rank's masters
        (see [Note: in-place edits after wrapping]); local. Nothing to do (the usual case) costs
        two reads per parameter."""
        taken = self._take_replaced_data()
        edited = self._wrapped_parameters.edited()
        if taken:  # their values are taken whole: a write through them since is not another edit
            edited = [p for p in edited if id(p) not in taken]
        if not edited:
            if taken:
                self._wrapped_parameters.record_versions()
            return
        ids = {id(p) for p in edited}
        for space, master, holds_values in self._master_chunks():
            params = {e.name: e.param for e in space.entries if id(e.param) in ids}
            if params and not holds_values:
                raise self._edited_stand_in(next(iter(params)))
            with torch.no_grad():
                for seg in space.segments(self.backend.rank):
                    if seg.name in params:
                        flat = params[seg.name].detach().reshape(-1)
                        values = flat[seg.param_offset:seg.param_offset + seg.length]
                        held = master.detach()[seg.shard_offset:seg.shard_offset + seg.length]
                        held.copy_(torch.where(values != held.to(values.dtype), values.to(held.dtype), held))
        self._wrapped_parameters.record_versions()

    def _edited_stand_in(self, name: str) -> ConfigError:
        return ConfigError(
            f"{type(self).__name__}: parameter {name!r} was written in place while its unit was "
            "resharded (between uses it holds a NaN stand-in, not the weights), so the write would be "
            "lost at its next gather; make the edit inside model.summon_full_parameters() (the same "
            "on every rank), or keep the unit gathered (ShardingConfig.replicate_below_numel)")

    def gather_full_parameters(self) -> dict[str, torch.Tensor]:
        self._take_in_place_edits()
        return super().gather_full_parameters()

    def _read_layout(self) -> ShardLayout:
        """As ShardedModelBase's, once the edits made before a load are taken: the load overwrites
        them as one process's would, and what it leaves (``strict=False``) keeps them."""
        self._take_in_place_edits()
        return super()._read_layout()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        self._take_in_place_edits()
        return super().state_dict(*args, **kwargs)

    @contextlib.contextmanager
    def summon_full_parameters(self, *, writeback: bool = True) -> Iterator[None]:
        """As ShardedModelBase's. An in-place edit made before entering is written into the masters
        first (the block sees it); writes inside the block are its own (written back or dropped),
        which the next forward does not take again."""
        if not getattr(self, "_summoned", False):  # entering again is refused below
            self._take_in_place_edits()
        try:
            with super().summon_full_parameters(writeback=writeback):
                yield
        finally:
            self._wrapped_parameters.record_versions()
