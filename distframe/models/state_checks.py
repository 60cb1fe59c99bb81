"""What ``load_state_dict`` checks before anything changes: that the state it is given (merged
``state_dict()`` pieces, a plain state dict, a RangeReader) is this model's, as torch's strict
``load_state_dict`` checks a plain module's.

[Note: checking pieces]
Pieces (``param/<name>@<offset>``) hold no shapes, and a read of "elements a:b of p" succeeded
wherever pieces covered a:b: pieces of a Linear(4, 4) loaded into a Linear(4, 3) as its first
elements, a bigger model's extra pieces were ignored, a smaller model's missing ones gave a
KeyError. A state may also hold only what some ranks read (one rank's own ``state_dict()``, one
pipeline stage's), so a parameter without pieces is not wrong in itself. The checks, before any
read:

* the same on every rank (``check_pieces``): pieces reaching past a parameter's last element (saved
  from a bigger one), a parameter stored frozen (whole) with another shape, and, when ``strict``,
  any name the model does not have (``strict=False`` ignores those, as torch does);
* on each rank (``sharded_state.check_covered``, in ``fill_shards``): every range it reads is held,
  else the parameters it lacks are missing, or (held in part) were saved smaller or not merged.
  ``strict=False`` excuses a parameter, buffer or extra state of which the state holds nothing,
  as torch's does: ``load_state_dict`` reads this rank's current values in its place (the same
  on every rank), so a pretrained body loads under a fresh head; one held in part is still refused.

Pieces tell element counts, not shapes: a (2, 8) weight loads the pieces of a (4, 4) one (a
plain state dict's shapes and a checkpoint's metadata are checked exactly). Pure bookkeeping; no
communication.
"""
from __future__ import annotations

from typing import Any

import torch

from distframe.errors import ConfigError
from distframe.models.sharded_state import RangeReader, full_state_pieces, numel_of

_SHOWN = 5


def loading_reader(state: dict[str, torch.Tensor] | RangeReader, trainable: dict[str, dict],
                   replicated: set[str], aliases: dict[str, str], *, strict: bool) -> RangeReader:
    """What ``load_state_dict`` reads ``state`` through, once checked: a RangeReader as it is,
    merged pieces, or the unwrapped model's plain state dict (every key without a "/")."""
    if not isinstance(state, RangeReader) and state and not any("/" in k for k in state):
        state = full_state_pieces(state, trainable, replicated, aliases, strict=strict)
    reader = state if isinstance(state, RangeReader) else RangeReader.from_tensors(state)
    check_pieces(reader, trainable, replicated | set(aliases), strict=strict)
    return reader


def incompatible_keys(state: dict[str, torch.Tensor] | RangeReader, reader: RangeReader, keys: list[str],
                      known: set[str], aliases: dict[str, str]) -> tuple[list[str], list[str]]:
    """``(missing_keys, unexpected_keys)`` as torch's ``load_state_dict`` returns them: the model's
    state-dict ``keys`` (in order) that ``state`` lacks, and the names it holds that are not
    ``known`` (keys, buffers, frozen parameters, extra state). A plain state dict is read by key,
    as torch reads it; pieces by name, a tied weight's further names (``aliases``) present with it."""
    known = known | set(keys)
    if not isinstance(state, RangeReader) and state and not any("/" in k for k in state):
        return [k for k in keys if k not in state], [k for k in state if k not in known]
    stored = reader.stored_names()
    return [k for k in keys if aliases.get(k, k) not in stored], sorted(stored - known)


def check_pieces(reader: RangeReader, trainable: dict[str, dict[str, Any]], replicated: set[str], *,
                 strict: bool) -> None:
    """ConfigError naming every trainable parameter of ``trainable`` (name -> {"shape": ...}) that
    ``reader`` holds with another size, and, when ``strict``, every name it holds that is
    neither in ``trainable`` nor in ``replicated`` (buffers, frozen parameters, extra state,
    further names of tied weights). See [Note: checking pieces]."""
    sized = []
    for name, info in trainable.items():
        shape = list(info["shape"])
        if f"buffer/{name}" in reader.keys and not reader.holds("param", name):  # saved frozen
            stored = list(reader.replicated_shape(name, shape) or [])
            if stored != shape:
                sized.append(f"{name!r} has shape {shape} here, {stored} there (stored frozen)")
        elif reader.extent("param", name) > numel_of(shape):
            sized.append(_too_big(name, shape, reader.extent("param", name), "pieces"))
    unexpected = sorted(reader.stored_names() - set(trainable) - replicated) if strict else []
    if sized or unexpected:
        raise ConfigError(_describe("the state loaded does not fit this model", sized, unexpected,
                                    "strict=False ignores these"))


def check_optimizer_pieces(reader: RangeReader, trainable: dict[str, dict[str, Any]],
                           replicated: set[str]) -> None:
    """ConfigError naming every parameter whose per-element optimizer state (``optim.<key>``
    pieces) reaches past its last element, and every name state is kept for that the model has
    neither as a parameter nor frozen (``replicated``): another model's state, which loaded as
    the first elements of each parameter. A parameter without state is not an error (it starts
    fresh, as with torch); a range a rank reads and the state lacks is (``check_covered``)."""
    sized, unexpected = [], set()
    for kind in sorted(k for k in reader.kinds() if k.startswith("optim.")):
        for name in sorted(reader.names(kind)):
            if name not in trainable:
                if name not in replicated:
                    unexpected.add(name)
            elif reader.extent(kind, name) > numel_of(trainable[name]["shape"]):
                sized.append(_too_big(name, list(trainable[name]["shape"]), reader.extent(kind, name),
                                      f"its {kind.removeprefix('optim.')!r} state"))
    if sized or unexpected:
        raise ConfigError(_describe("the optimizer state loaded does not fit this model", sized,
                                    sorted(unexpected), "of parameters this model does not have"))


def _too_big(name: str, shape: list[int], extent: int, what: str) -> str:
    return (f"{name!r} has shape {shape} ({numel_of(shape)} elements) here, {what} reach element "
            f"{extent - 1} there")


def _describe(what: str, sized: list[str], unexpected: list[str], note: str) -> str:
    parts = []
    if sized:
        parts.append("parameter(s) of another size: " + "; ".join(sized[:_SHOWN]) + _more(sized))
    if unexpected:
        parts.append(f"unexpected name(s) {unexpected[:_SHOWN]}{_more(unexpected)} ({note})")
    return (f"{what}: {'; '.join(parts)}. It was saved from another model; load every rank's "
            "state_dict() merged, or the unwrapped model's state dict, of this model")


def _more(names: list[str]) -> str:
    return f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""


def refuse_nested_state_dict(strategy: str, args: tuple, kwargs: dict[str, Any]) -> None:
    """ConfigError when torch asks for a sharded model's entries in a holder's ``state_dict()``."""
    if args or kwargs.get("prefix") or kwargs.get("destination") is not None:
        held_as = str(kwargs.get("prefix", "")).rstrip(".") or "a submodule"
        raise ConfigError(
            f"the state_dict() of a module holding {strategy} (as {held_as!r}) cannot "
            "include it: a sharded model's state_dict() is this rank's share, and leaving it out "
            "would lose it; save the sharded model itself (distframe.checkpoint.save(path, model, "
            "optimizer), or its gather_full_parameters()) and the other parts on their own")
