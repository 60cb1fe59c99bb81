"""summon_full_parameters: every parameter of a data-parallel model whole, at master precision,
inside a ``with`` block, for the code that reads or edits weights outside a training step
(an EMA, a weight norm logged, an evaluation of edited weights, a re-initialisation), as FSDP1's
``summon_full_params`` and DeepSpeed's ``GatheredParameters`` give it.

[Note: summoning] A strategy names its flat spaces (``Summonable``): each one's layout, this
rank's master chunk and, where the model computes from a flat copy of them (ZeRO-1/2's compute
buffer), that copy. Entering all-gathers each master chunk (one all_gather per space, the only
communication) and points every parameter of the space at its view of the gathered tensor
(``p.data``, so the Parameter, its ``.grad`` and its hooks stay as they are). Leaving puts the
parameters back as they were (ZeRO-3/FSDP's stand-ins between uses) and, with ``writeback``,
copies this rank's chunk of what it holds into its master and the whole into the compute copy,
with no communication. An exception inside the block writes nothing back (the model is as it
was on entering) and leaves every rank able to go on. Each rank
keeps its own chunk of what it wrote, so edits must be made alike on every rank (as with FSDP1).
The parameters the strategy does not shard (DDP's, frozen ones) are the model's own: they are
already whole, and unless the block completes with ``writeback`` what it changed of them is
restored from a copy taken on entering, without writing the rest (``_restore``). Nothing is
written where the block only read, so a read between a forward and its backward leaves that
backward as it was (the parameters a forward saved keep their autograd versions).

``full_state_dict`` assembles what ``gather_full_parameters()`` returns.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError
from distframe.models.flat import FlatSpace


@dataclasses.dataclass(frozen=True)
class Summonable:
    """One flat space whose chunk ``master`` this rank holds; ``compute`` is the full flat copy the
    model computes from (its parameters' storage between steps), when there is one."""
    space: FlatSpace
    master: torch.Tensor
    compute: torch.Tensor | None = None


@contextlib.contextmanager
def summoned(spaces: list[Summonable], whole: list[nn.Parameter], backend: ICommunicationBackend, *,
             writeback: bool, writing: Callable[[], None]) -> Iterator[None]:
    """See [Note: summoning]. ``whole``: parameters that are already whole (copied on entering and
    restored unless the block completes with ``writeback``). Only spaces written in the block
    are written back (a parameter's ``_version`` counts in-place writes to it; a replaced
    ``.data`` is taken too); ``writing`` tells the strategy first, and may refuse it."""
    gathered = [backend.all_gather(s.master.detach()) for s in spaces]
    held = [[p.data for p in s.space.params] for s in spaces]
    whole_held = [p.data for p in whole]
    kept = [p.detach().clone() for p in whole]
    views = [s.space.views(full) for s, full in zip(spaces, gathered)]
    _attach(spaces, views)
    versions = [[p._version for p in s.space.params] for s in spaces]
    completed, written = False, []
    try:
        yield
        completed = True
    finally:
        if completed and writeback:
            written = [k for k, s in enumerate(spaces)
                       if _take_replaced(s, views[k]) or [p._version for p in s.space.params] != versions[k]]
        _attach(spaces, held)
        if not (completed and writeback):
            _restore(whole, whole_held, kept)
    if written:
        writing()
        with torch.no_grad():
            for k in written:
                spaces[k].master.copy_(spaces[k].space.shard_of(gathered[k], backend.rank))
                if spaces[k].compute is not None:
                    spaces[k].compute.copy_(gathered[k])


def _restore(whole: list[nn.Parameter], held: list[torch.Tensor], kept: list[torch.Tensor]) -> None:
    """Puts back what the block changed of ``whole`` (held: their ``.data`` on entering; kept:
    copies of their values), and nothing else: a replaced ``.data`` is reattached, and values are
    written through the ``.data`` alias only where they differ. Writing every parameter with
    ``param.copy_`` bumped its autograd version, so a read between a forward and its backward
    broke that backward ("modified by an inplace operation")."""
    with torch.no_grad():
        for param, data, value in zip(whole, held, kept):
            if param.data.data_ptr() != data.data_ptr() or param.data.shape != data.shape:
                param.data = data
            if not torch.equal(data, value):
                data.copy_(value)  # the alias has its own version counter: the parameter's stays


def _take_replaced(space: Summonable, views: list[torch.Tensor]) -> bool:
    """A parameter whose ``.data`` the block replaced (``p.data = p.data * 0.5``) rather than
    wrote in place: its new values go into its view of the gathered tensor. Whether there was one."""
    replaced = False
    with torch.no_grad():
        for entry, view in zip(space.space.entries, views):
            data = entry.param.data
            if data.data_ptr() == view.data_ptr() and data.shape == view.shape:
                continue
            if data.shape != view.shape:
                raise ConfigError(
                    f"summon_full_parameters(): {entry.name!r} was given data of shape "
                    f"{tuple(data.shape)} in the block, but it has shape {tuple(view.shape)}; "
                    "write values of its own shape (p.copy_(...), or p.data = a tensor of it)")
            view.copy_(data)
            replaced = True
    return replaced


def _attach(spaces: list[Summonable], data: list[list[torch.Tensor]]) -> None:
    with torch.no_grad():
        for s, tensors in zip(spaces, data):
            for param, tensor in zip(s.space.params, tensors):
                param.data = tensor


def refuse_while_summoned(model: nn.Module, what: str) -> None:
    """ConfigError when ``model`` is inside its ``summon_full_parameters`` block."""
    if getattr(model, "_summoned", False):
        raise ConfigError(
            f"{type(model).__name__}: {what} inside summon_full_parameters(), whose parameters are "
            "the gathered master copies (no hooks gather, free or reduce them there); leave the "
            "with block first")


def full_state_dict(module: nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``module``'s state dict with its parameters taken from ``params`` (full copies by first
    name; a shared parameter's other names take the same) and copies of everything else."""
    first = {id(p): n for n, p in module.named_parameters()}  # a shared one's first name
    out = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        gathered = params.get(name, params.get(first.get(id(tensor), name)))  # any name of a shared one
        out[name] = gathered if gathered is not None else tensor.detach().clone()
    return out
