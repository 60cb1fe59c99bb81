"""Index plans: where each dilated branch reads its compressed segments from.

A branch ``(w, r)`` cuts the sequence into segments of length ``w' = min(w, seq)`` (the last may
be shorter) and, for head h, keeps the positions ``segment_start + o_h + j * r`` with
``o_h = h // ceil(H / r)``. A *slot* ``(s, h, j)`` of the compressed tensor ``(nseg, H, M, D)``
(``M = w' / r``) holds that position. A plan is made for one contiguous slice
``[start, stop)`` of the sequence (the whole sequence on one device, one rank's slice in the ring):
it covers every segment that meets the slice. Query rows are valid where the slot's position lies
in the slice; keys come from the slice itself or, in the ring, from the rank that owns them.

Indices address a ``(B, T_local, H, D)`` tensor viewed as ``(B, T_local * H, D)``:
``flat = (position - start) * H + h``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from attention.reference import head_offsets


@dataclass(frozen=True, kw_only=True)
class BranchPlan:
    """Compressed layout of one branch for the slice ``[start, stop)`` of a ``seq_len`` sequence."""

    seq_len: int
    start: int
    stop: int
    segment_length: int  # effective: min(w, seq_len)
    dilation_rate: int
    num_heads: int
    first_segment: int
    num_segments: int
    slot_positions: torch.Tensor  # (nseg, H, M) global positions, may be >= seq_len

    @property
    def rows_per_segment(self) -> int:
        return self.slot_positions.shape[-1]

    @property
    def num_slots(self) -> int:
        return self.slot_positions.numel()

    @cached_property
    def slot_heads(self) -> torch.Tensor:
        heads = torch.arange(self.num_heads, device=self.slot_positions.device)
        return heads.view(1, -1, 1).expand_as(self.slot_positions)

    @cached_property
    def local_slots(self) -> torch.Tensor:
        """Flat slot indices whose position lies in ``[start, stop)`` (valid query rows)."""
        pos = self.slot_positions.reshape(-1)
        return torch.nonzero((pos >= self.start) & (pos < self.stop)).flatten()

    def local_flat(self, slots: torch.Tensor) -> torch.Tensor:
        """Flat ``(B, T_local*H)`` index of the given slots (which must be local)."""
        pos = self.slot_positions.reshape(-1)[slots]
        heads = self.slot_heads.reshape(-1)[slots]
        return (pos - self.start) * self.num_heads + heads

    @cached_property
    def local_targets(self) -> torch.Tensor:
        """Flat local index of every slot in ``local_slots``, in the same order."""
        return self.local_flat(self.local_slots)

    @cached_property
    def gather_index(self) -> torch.Tensor:
        """Flat local index for every slot; slots outside the slice are clamped (rows unused)."""
        pos = self.slot_positions.clamp(self.start, self.stop - 1)
        return ((pos - self.start) * self.num_heads + self.slot_heads).reshape(-1)

    @cached_property
    def all_slots_local(self) -> bool:
        """True when every slot holds a position of the slice (no padding rows)."""
        pos = self.slot_positions
        return bool(((pos >= self.start) & (pos < self.stop)).all())

    def missing_keys(self, is_causal: bool) -> torch.Tensor | None:
        """``(nseg, H, M)`` bool of slots that hold no key and are not hidden by causality."""
        if is_causal:
            return None  # such slots sit after every valid query row of their segment
        missing = self.slot_positions >= self.seq_len
        return missing if bool(missing.any()) else None


def make_branch_plan(*, seq_len: int, start: int, stop: int, segment_length: int,
                     dilation_rate: int, num_heads: int,
                     device: torch.device | None = None) -> BranchPlan:
    """Plan of branch ``(segment_length, dilation_rate)`` for the slice ``[start, stop)``."""
    w = min(segment_length, seq_len)
    first = start // w
    num_segments = math.ceil(stop / w) - first
    rows = math.ceil(w / dilation_rate)  # w' = seq may not divide by r
    seg_starts = (torch.arange(num_segments) + first) * w  # (nseg,)
    offsets = torch.tensor(head_offsets(num_heads, dilation_rate))  # (H,)
    within = torch.arange(rows) * dilation_rate  # (M,)
    slots = seg_starts.view(-1, 1, 1) + offsets.view(1, -1, 1) + within.view(1, 1, -1)
    return BranchPlan(seq_len=seq_len, start=start, stop=stop, segment_length=w,
                      dilation_rate=dilation_rate, num_heads=num_heads, first_segment=first,
                      num_segments=num_segments, slot_positions=slots.to(device))
