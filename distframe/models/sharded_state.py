"""Sharded state: what a rank holds, keyed by parameter ranges so any layout can read it.

A local shard is a 1-D tensor the optimizer updates (a bucket chunk, a unit chunk, or a whole
replicated parameter); ``ShardLayout`` says which ranges of which parameters it holds. State is
written as ``{"param/<name>@<offset>": 1-D slice, "optim.<key>/<name>@<offset>": slice,
"buffer/<name>": tensor}`` (buffers, frozen parameters and module extra state, whole);
``RangeReader`` answers "elements a:b of parameter p" from any set of such pieces, which is what
lets a checkpoint saved under one strategy and world size load under another. Pure bookkeeping
and copies; no communication.
"""
from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterable, Sequence

import torch

from distframe.errors import ConfigError
from distframe.models.extra_state import (check_extra_state, extra_state_modules, extra_state_tensors,
                                          is_extra_state)
from distframe.models.flat import Segment


@dataclasses.dataclass
class ShardLayout:
    """``shards[i]`` holds ``segments[i]``; ``replicated``: every rank holds the same shards."""

    shards: list[torch.Tensor]
    segments: list[list[Segment]]
    replicated: bool = False

    def owned(self, rank: int, world_size: int) -> list[list[Segment]]:
        """The segments this rank writes: all it holds, or for replicated state an even
        1/world_size slice of each segment, so writing is shared and nothing is written twice."""
        if not self.replicated:
            return self.segments
        out = []
        for segs in self.segments:
            mine = []
            for s in segs:
                per = -(-s.length // world_size)
                lo, hi = min(s.length, rank * per), min(s.length, (rank + 1) * per)
                if lo < hi:
                    mine.append(Segment(s.shard_offset + lo, s.name, s.param_offset + lo, hi - lo))
            out.append(mine)
        return out


def piece_key(kind: str, name: str, offset: int) -> str:
    return f"{kind}/{name}@{offset}"


def parse_piece_key(key: str) -> tuple[str, str, int]:
    kind, rest = key.split("/", 1)
    name, offset = rest.rsplit("@", 1)
    return kind, name, int(offset)


def shard_pieces(layout: ShardLayout, rank: int, world_size: int, kind: str,
                 tensors: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """Slices of ``tensors`` (one per shard, same layout as the shards) for the owned segments."""
    out = {}
    for tensor, segs in zip(tensors, layout.owned(rank, world_size)):
        if tensor is None:
            continue
        flat = tensor.detach().reshape(-1)
        for s in segs:
            out[piece_key(kind, s.name, s.param_offset)] = flat[s.shard_offset:s.shard_offset + s.length].clone()
    return out


class RangeReader:
    """Reads ranges of flattened parameters (and whole buffers) from pieces named by
    ``piece_key``; ``fetch(key, lo, hi)`` returns elements lo:hi of one stored piece (the whole
    tensor, shaped, when ``hi`` is None); ``shape_of(key)`` its shape without reading it."""

    def __init__(self, pieces: Iterable[tuple[str, int]],
                 fetch: Callable[[str, int, int | None], torch.Tensor],
                 shape_of: Callable[[str], Sequence[int]] | None = None) -> None:
        self._fetch = fetch
        self._shape_of = shape_of or (lambda key: fetch(key, 0, None).shape)
        self._index: dict[tuple[str, str], list[tuple[int, int, str]]] = {}
        self.keys: set[str] = set()
        for key, numel in pieces:
            self.keys.add(key)
            if key.startswith("buffer/"):
                continue
            kind, name, offset = parse_piece_key(key)
            self._index.setdefault((kind, name), []).append((offset, numel, key))
        for runs in self._index.values():
            runs.sort()

    @classmethod
    def from_tensors(cls, state: dict[str, torch.Tensor]) -> RangeReader:
        return cls(((k, v.numel()) for k, v in state.items()),
                   lambda key, lo, hi: state[key] if hi is None else state[key].reshape(-1)[lo:hi],
                   lambda key: state[key].shape)

    def with_pieces(self, extra: dict[str, torch.Tensor]) -> RangeReader:
        """This reader and ``extra`` (pieces of names it holds nothing of) as one reader."""
        held = [(key, numel) for runs in self._index.values() for _, numel, key in runs]
        held += [(key, 0) for key in self.keys if key.startswith("buffer/")]  # numel unused for these
        extra_reader = RangeReader.from_tensors(extra)
        return RangeReader(held + [(k, v.numel()) for k, v in extra.items()],
                           lambda key, lo, hi: (extra_reader if key in extra else self)._fetch(key, lo, hi),
                           lambda key: (extra_reader if key in extra else self)._shape_of(key))

    def stored_names(self) -> set[str]:
        """Every name a parameter piece or a whole (``buffer/``) piece is stored for."""
        return self.names("param") | {k.removeprefix("buffer/") for k in self.keys if k.startswith("buffer/")}

    def kinds(self) -> set[str]:
        return {kind for kind, _ in self._index}

    def holds(self, kind: str, name: str) -> bool:
        """Whether any piece of ``kind`` (``"param"``, ``"optim.exp_avg"``) belongs to ``name``."""
        return (kind, name) in self._index

    def read(self, kind: str, name: str, start: int, length: int) -> torch.Tensor:
        runs = self._index.get((kind, name))
        if length == 0:  # nothing to read: a parameter without elements has no pieces
            return self._fetch(runs[0][2], 0, 0) if runs else torch.empty(0)
        if not runs and kind == "param" and f"buffer/{name}" in self.keys:
            return self._read_frozen(name, start, length)
        if not runs:
            raise KeyError(f"no stored {kind} data for parameter {name!r}")
        slices, gap = self._slices(runs, start, start + length)
        if gap is not None:
            raise KeyError(f"stored {kind} data for {name!r} does not cover element {gap}")
        parts = [self._fetch(key, lo, hi) for key, lo, hi in slices]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def uncovered(self, kind: str, name: str, start: int, length: int) -> int | None:
        """The first element of ``start:start + length`` of ``name`` that ``read`` would not
        find (a parameter stored frozen counts whole), or None when it would find them all."""
        runs = self._index.get((kind, name))
        if length == 0:
            return None
        if not runs and kind == "param" and f"buffer/{name}" in self.keys:
            numel = numel_of(self._shape_of(f"buffer/{name}"))
            return None if start + length <= numel else max(start, numel)
        return self._slices(runs, start, start + length)[1] if runs else start

    @staticmethod
    def _slices(runs: list[tuple[int, int, str]], start: int, end: int) -> tuple[list, int | None]:
        """(key, lo, hi) of each stored piece that holds elements start:end, in order, and the
        first element that none holds (None when they hold all)."""
        slices, pos = [], start
        i = max(0, bisect.bisect_right(runs, (start, float("inf"), "")) - 1)
        while pos < end:
            if i >= len(runs) or runs[i][0] > pos or runs[i][0] + runs[i][1] <= pos:
                return slices, pos
            offset, numel, key = runs[i]
            hi = min(end, offset + numel)
            slices.append((key, pos - offset, hi - offset))
            pos = hi
            i += 1
        return slices, None

    def _read_frozen(self, name: str, start: int, length: int) -> torch.Tensor:
        """Elements ``start:start + length`` of parameter ``name``, stored frozen (whole, as a
        buffer) and read by a model that trains it. A backstop for the callers' shape checks
        (state_checks, checkpoint.load's): a read past its end is a ConfigError naming both."""
        stored = tuple(self._shape_of(f"buffer/{name}"))
        if start + length > numel_of(stored):
            raise ConfigError(f"parameter {name!r} is stored frozen with shape {list(stored)} "
                              f"({numel_of(stored)} elements), but its elements {start}:{start + length} "
                              "were to be read: the model's parameter has another shape")
        return self.buffer(name).reshape(-1)[start:start + length]

    def names(self, kind: str) -> set[str]:
        """The names that pieces of ``kind`` are stored for."""
        return {name for k, name in self._index if k == kind}

    def covered(self, kind: str, name: str) -> int:
        """How many elements the pieces of ``kind`` stored for ``name`` hold together."""
        return sum(numel for _, numel, _ in self._index.get((kind, name), []))

    def extent(self, kind: str, name: str) -> int:
        """One past the last element the pieces of ``kind`` stored for ``name`` hold (0: none)."""
        return max((offset + numel for offset, numel, _ in self._index.get((kind, name), [])), default=0)

    def whole(self, kind: str, name: str) -> torch.Tensor:
        """The one piece of ``kind`` stored for ``name``, whole (state kept per rank, such as
        generator states, rather than ranges of a parameter)."""
        runs = self._index.get((kind, name), [])
        if len(runs) != 1 or runs[0][0] != 0:
            raise KeyError(f"no single stored {kind} piece for {name!r}")
        return self._fetch(runs[0][2], 0, None)

    def wholes(self, kind: str, prefix: str) -> dict[str, torch.Tensor]:
        """``whole(kind, prefix + rest)`` of every piece of ``kind`` stored under ``prefix``, by
        ``rest``."""
        return {name[len(prefix):]: self.whole(kind, name) for k, name in self._index
                if k == kind and name.startswith(prefix)}

    def buffer(self, name: str) -> torch.Tensor:
        key = f"buffer/{name}"
        if key not in self.keys:
            raise KeyError(f"no stored buffer {name!r}")
        return self._fetch(key, 0, None)

    def replicated_shape(self, name: str, shape: Sequence[int]) -> tuple[int, ...] | None:
        """The stored shape of buffer or frozen parameter ``name`` (None when it is not stored).
        Parameter pieces (the saving model trained it) hold no shape: ``shape`` when their
        element count is that shape's, else their count."""
        if f"buffer/{name}" in self.keys:
            return tuple(self._shape_of(f"buffer/{name}"))
        if not self.holds("param", name):
            return None
        covered = self.covered("param", name)
        return tuple(shape) if covered == numel_of(shape) else (covered,)

    def replicated(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """Buffer or frozen parameter ``name`` of ``shape``: stored whole, or as parameter pieces
        when the saving model trained it."""
        if f"buffer/{name}" in self.keys:
            return self.buffer(name)
        return self.read("param", name, 0, numel_of(shape)).reshape(tuple(shape))



def non_persistent_buffers(module: torch.nn.Module) -> set[str]:
    """Names (as ``named_buffers`` gives them) of ``module``'s buffers registered with
    ``persistent=False``: caches the module rebuilds, which torch leaves out of its state_dict, so
    a checkpoint leaves them out too (saved, they made ``consolidate``'s output fail a strict
    ``load_state_dict`` and a load into a model with another cache size fail). Read from torch's
    own record of them: the state_dict's keys would lose buffers a state_dict hook renames."""
    return {f"{prefix}.{name}" if prefix else name for prefix, sub in module.named_modules()
            for name in sub._non_persistent_buffers_set}


def replicated_state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Frozen parameters, persistent buffers and extra state of ``module``, by state-dict name."""
    frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
    skipped = non_persistent_buffers(module)
    buffers = [(n, b) for n, b in module.named_buffers() if n not in skipped]
    return frozen + buffers + extra_state_tensors(module)


def replicated_state_names(module: torch.nn.Module) -> set[str]:
    """Every frozen-parameter, buffer (non-persistent ones too) and extra-state name of ``module``."""
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    extra = {n for n, _ in extra_state_modules(module)}
    return frozen | extra | {n for n, _ in module.named_buffers()}


def trainable_metadata(module: torch.nn.Module, layout: ShardLayout,
                       fallback: torch.dtype) -> dict[str, dict[str, object]]:
    """Name, shape and stored dtype (its shard's in ``layout``, else ``fallback``) of every
    trainable parameter of ``module``."""
    dtypes = {seg.name: shard.dtype for shard, segs in zip(layout.shards, layout.segments) for seg in segs}
    return {n: {"shape": list(p.shape), "dtype": str(dtypes.get(n, fallback)).removeprefix("torch.")}
            for n, p in module.named_parameters() if p.requires_grad}


def state_names(module: torch.nn.Module) -> list[tuple[str, str]]:
    """Each ``state_dict()`` key of ``module``, in order, with the name its tensor is stored under:
    the key, or for a tensor held under several (tied weights) the first of them."""
    first: dict[int, str] = {}
    held = module.state_dict(keep_vars=True)
    return [(key, first.setdefault(id(tensor), key)) for key, tensor in held.items()]


def current_pieces(layout: ShardLayout, replicated: Iterable[tuple[str, torch.Tensor]],
                   names: set[str]) -> dict[str, torch.Tensor]:
    """Copies of what this rank holds of ``names`` (the ``layout`` segments it reads, its
    ``replicated`` tensors) as pieces: what a ``strict=False`` load reads where the state lacks them."""
    pieces = {piece_key("param", s.name, s.param_offset):
              shard.detach().reshape(-1)[s.shard_offset:s.shard_offset + s.length].clone()
              for shard, segs in zip(layout.shards, layout.segments) for s in segs if s.name in names}
    pieces.update((f"buffer/{n}", t.detach().clone()) for n, t in replicated if n in names)
    return pieces


def check_replicated(reader: RangeReader, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """ConfigError unless ``reader`` holds each buffer or frozen parameter of ``named`` with its
    shape: call it before anything changes, as ``copy_`` would broadcast a smaller one silently."""
    for name, tensor in named:
        stored = reader.replicated_shape(name, tensor.shape)
        if stored is None:
            kind = "extra state" if is_extra_state(name) else "buffer or frozen parameter"
            raise ConfigError(f"{kind} {name!r} is not in the state loaded; load_state_dict(state, "
                              "strict=False) keeps its current value, as torch's does")
        if stored != tuple(tensor.shape) and not is_extra_state(name):  # [Note: extra state]
            raise ConfigError(f"buffer or frozen parameter {name!r} has shape {list(tensor.shape)} "
                              f"here but {list(stored)} in the state loaded")


def numel_of(shape: Sequence[int]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel


def fill_shards(layout: ShardLayout, reader: RangeReader, kind: str,
                tensors: list[torch.Tensor]) -> None:
    """Copies every held segment of every shard from ``reader`` into ``tensors`` (in place);
    ConfigError first, before anything is copied, when ``reader`` lacks any of them."""
    check_covered(reader, kind, [s for segs in layout.segments for s in segs])
    with torch.no_grad():
        for tensor, segs in zip(tensors, layout.segments):
            flat = tensor.view(-1)
            for s in segs:
                piece = reader.read(kind, s.name, s.param_offset, s.length)
                flat[s.shard_offset:s.shard_offset + s.length].copy_(piece)


def full_state_pieces(state: dict[str, torch.Tensor], trainable: dict[str, dict], replicated: set[str],
                      aliases: dict[str, str], *, strict: bool = True) -> dict[str, torch.Tensor]:
    """A plain state dict (the unwrapped model's names, as ``gather_full_parameters()`` and
    ``distframe.checkpoint.consolidate`` return it) as pieces: one ``param/<name>@0`` per trainable
    parameter (``trainable``: name -> {"shape": ...}), ``buffer/<name>`` for the ``replicated``
    names, a tied weight's further names (``aliases``) read as its first. ConfigError for a
    parameter of another shape, or (``strict``) a trainable parameter missing or a name the model
    lacks (``strict=False``: left out, as torch leaves them)."""
    pieces, unexpected = {}, []
    for name, tensor in state.items():
        name = aliases.get(name, name)
        if name in trainable:
            if list(tensor.shape) != list(trainable[name]["shape"]):
                raise ConfigError(f"parameter {name!r} has shape {list(trainable[name]['shape'])} here but "
                                  f"{list(tensor.shape)} in the state dict loaded")
            pieces[piece_key("param", name, 0)] = tensor.detach().reshape(-1)
        elif name in replicated:
            if is_extra_state(name):
                check_extra_state(name, tensor)
            pieces[f"buffer/{name}"] = tensor.detach()
        else:
            unexpected.append(name)
    missing = [name for name in trainable if piece_key("param", name, 0) not in pieces]
    if strict and (missing or unexpected):
        prefixed = any(name.startswith("module.") for name in unexpected)
        raise ConfigError(
            f"the state dict loaded lacks parameter(s) {missing[:3]} and has unexpected key(s) "
            f"{unexpected[:3]}: pass strict=False to load it anyway, as torch's load_state_dict does "
            "(what it lacks keeps its current value, unexpected keys are ignored)"
            + (". Names are the unwrapped model's, as gather_full_parameters() gives them, without "
               "the 'module.' prefix" if prefixed else ""))
    return pieces


def check_covered(reader: RangeReader, kind: str, segments: list[Segment]) -> None:
    """ConfigError naming the parameters of ``segments`` (the ranges this rank reads) of which
    ``reader`` holds no ``kind`` data, and those of which it lacks a range: the state was saved
    from a smaller parameter, or is not every rank's ``state_dict()`` merged."""
    missing: list[str] = []
    short: dict[str, str] = {}
    for s in segments:
        gap = reader.uncovered(kind, s.name, s.param_offset, s.length)
        if gap is None or s.name in missing or s.name in short:
            continue
        if not reader.holds(kind, s.name) and not (kind == "param" and f"buffer/{s.name}" in reader.keys):
            missing.append(s.name)
        else:
            short[s.name] = (f"{s.name!r}: elements {s.param_offset}:{s.param_offset + s.length} read here, "
                             f"element {gap} not held")
    if missing or short:
        what = "parameter(s)" if kind == "param" else f"{kind} state of parameter(s)"
        kept = " (load_state_dict(state, strict=False) keeps their current values)" if kind == "param" else ""
        found = [f"missing {what} {missing[:5]}{kept}"] if missing else []
        found += [f"{what} not held whole: " + "; ".join(list(short.values())[:5])] if short else []
        raise ConfigError(f"the state loaded does not fit this model: {', '.join(found)}. It was saved "
                          "from a smaller model, or is not every rank's state_dict() merged")
