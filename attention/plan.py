"""Slot plans: where one head group of one dilated branch reads its compressed segments.

A branch ``(w, r)`` cuts the sequence into segments of length ``w' = min(w, seq)`` (the last may
be shorter) and, for head h, keeps positions ``segment_start + o + j * r`` with
``o = h // ceil(H / r)``. Heads sharing an offset form a *head group*; a plan covers one group.
A *slot* ``(s, h, j)`` of the compressed tensor ``(nseg, hg, M, D)`` (``M = ceil(w' / r)``)
holds one position. A plan is made for one contiguous slice ``[start, stop)`` of the sequence
(the whole sequence on one device, one rank's slice in the ring) and covers every segment that
meets the slice. Query rows are valid where the slot's position lies in the slice.

Two access paths return the same values: a *regular* plan (slice and sequence aligned to whole
segments, ``r`` dividing ``w'``) reads strided views of the ``(B, T, H, X)`` tensor, copying
nothing; any other plan gathers rows by index from its ``(B, T * H, X)`` view
(``flat = (position - start) * H + h``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property, wraps

import torch


def layout_property(build):
    """A ``cached_property`` built outside inference mode. Plans are cached across calls, and a
    layout first built under ``torch.inference_mode()`` (an evaluation pass) was an inference
    tensor, which autograd refuses to save: the next training forward that indexes with it (the
    attention-dropout path) raised "Inference tensors cannot be saved for backward".
    A plan on the meta device builds its layout on the CPU and moves it there: some layouts
    (``nonzero``) need values, which meta tensors (shape inference) do not have."""
    @wraps(build)
    def outside_inference_mode(self):
        with torch.inference_mode(False):
            if self.device is not None and torch.device(self.device).type == "meta":
                built = build(replace(self, device=torch.device("cpu")))
                return None if built is None else built.to("meta")
            return build(self)
    return cached_property(outside_inference_mode)


@dataclass(frozen=True, kw_only=True)
class SlotPlan:
    """Compressed layout of heads ``[head_start, head_stop)`` of one branch for ``[start, stop)``."""

    seq_len: int
    start: int
    stop: int
    segment_length: int  # effective: min(w, seq_len)
    dilation_rate: int
    offset: int
    head_start: int
    head_stop: int
    num_heads: int
    first_segment: int
    num_segments: int
    rows: int  # M
    device: torch.device | None

    @property
    def group_heads(self) -> int:
        return self.head_stop - self.head_start

    @layout_property
    def slot_positions(self) -> torch.Tensor:
        """``(nseg, hg, M)`` global position of every slot (may exceed the sequence)."""
        seg = (torch.arange(self.num_segments, device=self.device) + self.first_segment)
        within = torch.arange(self.rows, device=self.device) * self.dilation_rate + self.offset
        pos = seg.view(-1, 1) * self.segment_length + within.view(1, -1)  # (nseg, M)
        return pos.unsqueeze(1).expand(-1, self.group_heads, -1)

    @cached_property
    def regular(self) -> bool:
        w = self.segment_length
        return (self.start % w == 0 and self.stop % w == 0 and w % self.dilation_rate == 0)

    @layout_property
    def local_slots(self) -> torch.Tensor:
        """Flat slot indices whose position lies in ``[start, stop)`` (valid query rows)."""
        pos = self.slot_positions.reshape(-1)
        return torch.nonzero((pos >= self.start) & (pos < self.stop)).flatten()

    def flat_index(self, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Flat ``(T_local * H)`` index of ``positions`` held by the given flat slots."""
        heads = torch.arange(self.head_start, self.head_stop, device=self.device)
        heads = heads.view(1, -1, 1).expand_as(self.slot_positions).reshape(-1)[slots]
        return (positions - self.start) * self.num_heads + heads

    @layout_property
    def local_targets(self) -> torch.Tensor:
        return self.flat_index(self.slot_positions.reshape(-1)[self.local_slots],
                               self.local_slots)

    @layout_property
    def gather_index(self) -> torch.Tensor:
        """Flat local index for every slot; slots outside the slice are clamped (rows unused)."""
        pos = self.slot_positions.clamp(self.start, self.stop - 1).reshape(-1)
        return self.flat_index(pos, torch.arange(pos.numel(), device=self.device))

    @layout_property
    def outside_rows(self) -> torch.Tensor | None:
        """``(nseg, hg, M)`` bool of slots that are not this slice's queries (None: none)."""
        if self.regular:
            return None
        pos = self.slot_positions
        return (pos < self.start) | (pos >= self.stop)

    def missing_keys(self, is_causal: bool) -> torch.Tensor | None:
        """``(nseg, hg, M)`` bool of slots beyond the sequence that causality does not hide."""
        if is_causal or self.regular:
            return None  # under causality such slots follow every valid query of their segment
        last = ((self.first_segment + self.num_segments - 1) * self.segment_length
                + (self.rows - 1) * self.dilation_rate + self.offset)  # the largest slot position
        if last < self.seq_len:  # from the shapes, not the tensor: meta and fake tensors have no values
            return None
        with torch.inference_mode(False):  # kept by the key sources: see layout_property
            return self.slot_positions >= self.seq_len

    # -- access: compressed kernel tensors <-> rows of the local (B, T_local, H, X) tensor --

    def _strided(self, x: torch.Tensor) -> torch.Tensor:
        """Regular plans: ``(B, T, H, X) -> (B, nseg, hg, M, X)`` view of this group's slots."""
        batch, _, heads, width = x.shape
        view = x.view(batch, self.num_segments, self.rows, self.dilation_rate, heads, width)
        return view[:, :, :, self.offset, self.head_start:self.head_stop].permute(0, 1, 3, 2, 4)

    def segments(self, x: torch.Tensor) -> torch.Tensor:
        """Regular plans: ``(B, T, H, X) -> (B * nseg, hg, M, X)`` view of this group's slots, the
        layout of ``compressed``; writing to it writes to ``x`` (``view``: never a silent copy)."""
        rows = self._strided(x)
        return rows.view(-1, *rows.shape[2:])

    def compressed(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T_local, H, X) -> (B * nseg, hg, M, X)`` kernel input (a view when regular)."""
        batch, width = x.shape[0], x.shape[-1]
        if self.regular:
            return self._strided(x).flatten(0, 1)
        flat = x.reshape(batch, -1, width).index_select(1, self.gather_index)
        return flat.view(batch * self.num_segments, self.group_heads, self.rows, width)

    def valid(self, yc: torch.Tensor, batch: int) -> torch.Tensor:
        """Kernel output ``(B * nseg, hg, M, X)`` -> its valid rows in the plan's row order."""
        if self.regular:
            return yc.view(batch, self.num_segments, self.group_heads, self.rows, -1)
        return yc.reshape(batch, -1, yc.shape[-1]).index_select(1, self.local_slots)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of the local tensor ``(B, T_local, H, X)`` in the plan's row order."""
        if self.regular:
            return self._strided(x)
        return x.view(x.shape[0], -1, x.shape[-1]).index_select(1, self.local_targets)

    def write_local(self, x: torch.Tensor, values: torch.Tensor) -> None:
        if self.regular:
            self._strided(x).copy_(values)
        else:
            x.view(x.shape[0], -1, x.shape[-1]).index_copy_(1, self.local_targets,
                                                            values.to(x.dtype))

    def add_local(self, x: torch.Tensor, values: torch.Tensor) -> None:
        if self.regular:
            self._strided(x).add_(values)
        else:
            x.view(x.shape[0], -1, x.shape[-1]).index_add_(1, self.local_targets,
                                                           values.to(x.dtype))


def make_slot_plans(*, seq_len: int, start: int, stop: int, segment_length: int,
                    dilation_rate: int, num_heads: int, heads: tuple[int, int] | None = None,
                    device: torch.device | None = None) -> list[SlotPlan]:
    """One plan per head group of branch ``(segment_length, dilation_rate)`` for ``[start, stop)``.

    ``heads=(lo, hi)``: only heads ``[lo, hi)`` of the ``num_heads`` are held here (a rank of a
    head-split tensor-parallel group), renumbered from 0. Offsets stay those of the global head
    index, so the plans read what the dense module's would; groups with no head here are left out.
    """
    w = min(segment_length, seq_len)
    group = math.ceil(num_heads / dilation_rate)
    lo, hi = (0, num_heads) if heads is None else heads
    if not 0 <= lo < hi <= num_heads:
        raise ValueError(f"heads [{lo}, {hi}) do not fit in num_heads={num_heads}: a rank holds "
                         f"heads lo..hi-1 with 0 <= lo < hi <= {num_heads}")
    first = start // w
    plans = []
    for head_start in range(0, num_heads, group):
        held_start, held_stop = max(head_start, lo), min(head_start + group, num_heads, hi)
        if held_start >= held_stop:
            continue  # this head group lives on another rank
        plans.append(SlotPlan(
            seq_len=seq_len, start=start, stop=stop, segment_length=w,
            dilation_rate=dilation_rate, offset=head_start // group, head_start=held_start - lo,
            head_stop=held_stop - lo, num_heads=hi - lo,
            first_segment=first, num_segments=math.ceil(stop / w) - first,
            rows=math.ceil(w / dilation_rate), device=device))
    return plans
