"""Flat parameter spaces: parameters laid end to end in one 1-D space padded to a multiple of
the world size, so rank r owns the contiguous chunk r. Pure bookkeeping; no communication.

Used by the gradient buckets of DDP/ZeRO-1/ZeRO-2 (one space per bucket) and by the sharded
units of ZeRO-3/FSDP (one space per unit), and by checkpoints to map shards to parameters.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Segment:
    """``length`` elements at ``shard_offset`` of a local shard are elements
    ``param_offset:param_offset + length`` of the flattened parameter ``name``."""

    shard_offset: int
    name: str
    param_offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class FlatEntry:
    """``param``'s place in the space; its shape as it was when the space was made (ZeRO-3 and
    FSDP empty a parameter between uses: [Note: parameters between uses] in sharded_unit.py)."""
    name: str
    param: nn.Parameter
    offset: int
    shape: torch.Size

    @property
    def numel(self) -> int:
        return self.shape.numel()


class FlatSpace:
    """The parameters ``named_params`` (in this order) at consecutive offsets of a flat space of
    ``padded_numel`` elements, a multiple of ``world_size``; chunk r (``shard_numel`` elements)
    belongs to rank r."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], world_size: int) -> None:
        offset = 0
        entries = []
        for name, param in named_params:
            entries.append(FlatEntry(name, param, offset, param.shape))
            offset += param.numel()
        self.entries = entries
        # Buffers of this space live where its parameters do (a CUDA model's on its GPU).
        self.device = named_params[0][1].device if named_params else torch.device("cpu")
        self.numel = offset
        self.world_size = world_size
        self.padded_numel = -(-max(offset, 1) // world_size) * world_size
        self.shard_numel = self.padded_numel // world_size

    @property
    def params(self) -> list[nn.Parameter]:
        return [e.param for e in self.entries]

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def shard_of(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        start, end = self.shard_range(rank)
        return flat[start:end]

    def view(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Parameter ``k``'s view (its own shape) into the padded flat tensor ``flat``."""
        e = self.entries[k]
        return flat[e.offset:e.offset + e.numel].view(e.shape)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view (its own shape) into the padded flat tensor ``flat``."""
        return [flat[e.offset:e.offset + e.numel].view(e.shape) for e in self.entries]

    def flatten(self, tensors: list[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor:
        """A new padded flat tensor holding ``tensors`` (None reads as zeros)."""
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=self.device)
        for entry, t in zip(self.entries, tensors):
            if t is not None:
                flat[entry.offset:entry.offset + entry.numel].copy_(t.reshape(-1))
        return flat

    def chunk(self, tensors: list[torch.Tensor], rank: int, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor holding rank ``rank``'s chunk of ``tensors`` laid out flat, in ``dtype``
        (padding zero): master weights taken from the parameters' own values, not from a
        lower-precision flat copy of them."""
        out = torch.zeros(self.shard_numel, dtype=dtype, device=self.device)
        by_name = {e.name: t for e, t in zip(self.entries, tensors)}
        for seg in self.segments(rank):
            piece = by_name[seg.name].reshape(-1)[seg.param_offset:seg.param_offset + seg.length]
            out[seg.shard_offset:seg.shard_offset + seg.length].copy_(piece)
        return out

    def segments(self, rank: int) -> list[Segment]:
        """Where the parameters lie within rank ``rank``'s chunk (padding excluded)."""
        start, end = self.shard_range(rank)
        found = []
        for e in self.entries:
            lo, hi = max(start, e.offset), min(end, e.offset + e.numel)
            if lo < hi:
                found.append(Segment(lo - start, e.name, lo - e.offset, hi - lo))
        return found


def partition_into_buckets(named_params: list[tuple[str, nn.Parameter]], *, first_cap_bytes: int,
                           cap_bytes: int, element_size: int | None = None
                           ) -> list[list[tuple[str, nn.Parameter]]]:
    """Groups parameters in reverse registration order (the order backward produces their
    gradients) into buckets of at most ``cap_bytes`` (the first at most ``first_cap_bytes``);
    a parameter larger than the cap gets a bucket of its own."""
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    current: list[tuple[str, nn.Parameter]] = []
    size = 0
    for name, param in reversed(named_params):
        nbytes = param.numel() * (element_size or param.element_size())
        cap = first_cap_bytes if not buckets else cap_bytes
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append((name, param))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
