"""Param groups of different settings over a sharded model's local shards.

A user builds ``torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay,
"weight_decay": 0.0}], lr=3e-4)`` over the model's parameters; the sharded optimizer rebuilds it
over its local shards with the same groups, in the same order. Over a HybridShardedModel (a ZeRO
optimizer over its data-parallel group) the parameters are this rank's stages and tensor slices,
best chosen by their names in the unwrapped model (``model.dense_named_parameters()``).

Each shard is cut into *pieces*: maximal runs of consecutive parameters of one group (the padding
at the end of a chunk goes with the run before it, so the pieces tile the shard). A piece covering
a whole shard is the shard itself (DDP: every shard is one parameter, so its groups map parameter
by parameter); any other piece is a 1-D view of its shard, whose ``.grad`` is pointed at the same
range of the shard's gradient after each synchronisation (``GroupedShards.take_gradients``).
Updating a piece updates its shard: the model's collectives, memory and checkpoint ranges stay as
they were.

[Note: why the flat spaces are not reordered by group] DeepSpeed flattens one space per group,
and the flat spaces could instead be ordered by group so that each (space, group) is one range.
Neither fits here: a model's flat spaces (ZeRO's gradient buckets, ZeRO-3/FSDP's units) are laid
out when the model is wrapped, before its optimizer (and its groups) exists, and their bucket
boundaries fix the collectives and the overlap with backward; laying them out again at the
optimizer would re-flatten every space, re-make the masters (whose mixed-precision values exist
only in their chunks) and re-hook the gradients. Views cost nothing of that: the one price is that
the wrapped optimizer sees one tensor per group switch within a chunk (at most one per parameter,
as many as DDP gives it), which torch's foreach kernels take in one launch per group.
Pure bookkeeping; no communication.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import nn

from distframe.errors import ConfigError
from distframe.models.flat import Segment
from distframe.models.sharded_state import ShardLayout


@dataclasses.dataclass(frozen=True)
class _Piece:
    tensor: torch.Tensor
    shard: torch.Tensor
    start: int
    end: int

    @property
    def is_shard(self) -> bool:
        return self.tensor is self.shard


class GroupedShards:
    """The pieces of ``layout``'s shards, each in the group of its parameters (``group_of``:
    parameter name -> group index; ``shard_group``: id of a shard given whole -> group index)."""

    def __init__(self, layout: ShardLayout, group_of: dict[str, int], shard_group: dict[int, int],
                 num_groups: int, owner: str) -> None:
        self.pieces: list[_Piece] = []
        self.groups: list[list[torch.Tensor]] = [[] for _ in range(num_groups)]
        segments: list[list[Segment]] = []
        # A hybrid rank's layout says which ranges it writes too (WrittenOnceLayout.written: one
        # writer per range, where stages share a tied weight and tensor ranks a replicated one).
        written: list[list[Segment]] | None = getattr(layout, "written", None)
        pieces_written: list[list[Segment]] = []
        for i, (shard, segs) in enumerate(zip(layout.shards, layout.segments)):
            for group, start, end, run in _runs(shard, segs, group_of, shard_group.get(id(shard)), owner):
                whole = start == 0 and end == shard.numel()
                tensor = shard if whole else nn.Parameter(shard.data.view(-1)[start:end])
                self.pieces.append(_Piece(tensor, shard, start, end))
                self.groups[group].append(tensor)
                segments.append(_shifted(run, start, end))
                if written is not None:
                    pieces_written.append(_shifted(written[i], start, end))
        self.layout = dataclasses.replace(layout, shards=[p.tensor for p in self.pieces], segments=segments,
                                          **({} if written is None else {"written": pieces_written}))

    def take_gradients(self) -> None:
        """Points each piece's ``.grad`` at its range of its shard's gradient (None with it)."""
        for piece in self.pieces:
            if piece.is_shard:
                continue
            grad = piece.shard.grad
            piece.tensor.grad = None if grad is None else grad.view(-1)[piece.start:piece.end]


def _shifted(segments: list[Segment], start: int, end: int) -> list[Segment]:
    """Those of a shard's ``segments`` that lie in its piece ``start:end``, addressed in the piece."""
    return [dataclasses.replace(s, shard_offset=s.shard_offset - start) for s in segments
            if start <= s.shard_offset < end]


def _runs(shard: torch.Tensor, segments: list[Segment], group_of: dict[str, int], whole: int | None,
          owner: str) -> list[tuple[int, int, int, list[Segment]]]:
    """(group, start, end, segments) of each run of one group in ``shard``, tiling it."""
    if whole is not None or not segments:
        return [(0 if whole is None else whole, 0, shard.numel(), list(segments))]
    runs: list[tuple[int, int, int, list[Segment]]] = []
    for seg in sorted(segments, key=lambda s: s.shard_offset):
        if seg.name not in group_of:
            raise ConfigError(f"{owner}: the optimizer instance's param groups do not hold {seg.name!r}; "
                              "build the optimizer over the model's parameters (model.parameters())")
        group = group_of[seg.name]
        if runs and runs[-1][0] == group:
            runs[-1][3].append(seg)
        else:
            runs.append((group, 0 if not runs else seg.shard_offset, 0, [seg]))
    ends = [start for _, start, _, _ in runs[1:]] + [shard.numel()]
    return [(group, start, end, segs) for (group, start, _, segs), end in zip(runs, ends)]


def group_indices(optimizer: torch.optim.Optimizer, model: Any) -> tuple[dict[str, int], dict[int, int],
                                                                         list[list[str]]]:
    """(trainable parameter name -> its group, id of a tensor in a group -> its group, each group's
    trainable parameter names) of ``optimizer`` over ``model.wrapped_model``; the names are the
    unwrapped model's (a hybrid model's ``dense_named_parameters``), as its shard layout's."""
    by_id = {id(p): k for k, group in enumerate(optimizer.param_groups) for p in group["params"]}
    group_of: dict[str, int] = {}
    names: list[list[str]] = [[] for _ in optimizer.param_groups]
    dense_named = getattr(model, "dense_named_parameters", None)
    for name, param in dense_named() if dense_named else model.wrapped_model.named_parameters():
        if param.requires_grad and id(param) in by_id:
            group_of[name] = by_id[id(param)]
            names[by_id[id(param)]].append(name)
    return group_of, by_id, names


def build_grouped(optimizer: torch.optim.Optimizer,
                  groups: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class and defaults whose group k holds ``groups[k]`` with
    every setting of ``optimizer``'s group k (lr, weight_decay, betas, ... and keys others put
    there); a group with no tensor on this rank is kept, empty, so every rank has the same groups."""
    accepted = inspect.signature(type(optimizer).__init__).parameters.values()
    defaults = dict(optimizer.defaults)
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted):
        # AdamW's defaults hold decoupled_weight_decay, which its constructor refuses.
        names = {p.name for p in accepted}
        defaults = {k: v for k, v in defaults.items() if k in names}
    param_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": tensors}
                    for group, tensors in zip(optimizer.param_groups, groups)]
    rebuilt = type(optimizer)(param_groups, **defaults)
    for group, ours in zip(optimizer.param_groups, rebuilt.param_groups):
        ours.update({k: v for k, v in group.items() if k != "params"})
    return rebuilt
