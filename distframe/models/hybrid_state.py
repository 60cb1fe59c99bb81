"""Where a model-parallel rank's parameters sit in the dense model, and how they are saved.

``ParameterCatalog`` records, before anything is split, every parameter and buffer of the dense
model (canonical name, shape, dtype, the state-dict keys that alias it, the pipeline stages that
hold it). ``LocalParameter`` says which dense parameter a local tensor is and along which dim
tensor parallelism split it. From those two:

* ``shard_layout``: the flat ranges of each dense parameter this rank holds (a column split is
  one contiguous range; a row split is one range per row), for the ``param/<name>@<offset>``
  pieces of ``ShardedModelBase``'s sharded state;
* ``gather_full``: the dense state dict on every rank (collective: one all_gather per split
  parameter over the tensor group, then one broadcast per stage and dtype over the pipeline group).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import ReduceOp
from distframe.models.flat import Segment
from distframe.models.sharded_state import ShardLayout, non_persistent_buffers
from distframe.mesh import ParallelGroups


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    stages: tuple[int, ...]

    @property
    def owner_stage(self) -> int:
        return self.stages[0]


@dataclasses.dataclass(frozen=True)
class LocalParameter:
    name: str
    param: nn.Parameter
    split_dim: int | None


class ParameterCatalog:
    """The dense model's parameters and buffers, and which stages hold each."""

    def __init__(self, model: nn.Module, stage_modules: list[list[nn.Module]]) -> None:
        param_stages: dict[int, list[int]] = {}
        buffer_stages: dict[int, list[int]] = {}
        for s, modules in enumerate(stage_modules):
            for module in modules:
                for p in module.parameters():
                    param_stages.setdefault(id(p), []).append(s)
                for b in module.buffers():
                    buffer_stages.setdefault(id(b), []).append(s)
        self.params = [Entry(n, tuple(p.shape), p.dtype, tuple(sorted(set(param_stages.get(id(p), [0])))))
                       for n, p in model.named_parameters()]
        self.buffers = [Entry(n, tuple(b.shape), b.dtype, tuple(sorted(set(buffer_stages.get(id(b), [0])))))
                        for n, b in model.named_buffers()]
        canonical = {id(p): n for n, p in model.named_parameters()}
        canonical.update({id(b): n for n, b in model.named_buffers()})
        # Every key of the dense state dict, in order, and the canonical entry it reads.
        self.state_keys = [(k, canonical.get(id(t), k)) for k, t in model.state_dict(keep_vars=True).items()]
        self.by_name = {e.name: e for e in self.params + self.buffers}
        self.non_persistent = non_persistent_buffers(model)  # not checkpointed, as with torch

    def metadata(self) -> dict[str, dict[str, Any]]:
        """Name, dense shape and dtype of every parameter of the unsplit model (the same on every
        rank), for checkpoint metadata; ``wrapped_model`` holds only this rank's stage and shards."""
        return {e.name: {"shape": list(e.shape), "dtype": str(e.dtype).removeprefix("torch.")}
                for e in self.params}

    def shared_across_stages(self) -> dict[tuple[int, ...], list[str]]:
        """Parameters held by more than one stage (tied weights), grouped by the stages."""
        out: dict[tuple[int, ...], list[str]] = {}
        for e in self.params:
            if len(e.stages) > 1:
                out.setdefault(e.stages, []).append(e.name)
        return out


def shard_layout(local: list[LocalParameter], catalog: ParameterCatalog, tp_index: int,
                 tp_size: int) -> ShardLayout:
    segments = []
    for lp in local:
        full = catalog.by_name[lp.name].shape
        segments.append(_segments(lp.name, full, lp.split_dim, tp_index, tp_size))
    return ShardLayout(shards=[lp.param for lp in local], segments=segments)


@dataclasses.dataclass
class WrittenOnceLayout(ShardLayout):
    """A hybrid rank's layout for optimizer state: ``segments`` are all it holds (what loading
    fills), ``owned()`` only ``written``, the ranges it writes (and counts in a global norm), so
    data-parallel replicas, the tensor ranks of a replicated parameter and the stages sharing a
    tied weight do not write the same range twice (``owns_piece``; under ZeRO, whose chunks are
    disjoint over data parallelism, ``zero_counted_segments``)."""

    written: list[list[Segment]] = dataclasses.field(default_factory=list)

    def owned(self, rank: int, world_size: int) -> list[list[Segment]]:  # noqa: ARG002
        return self.written


def _segments(name: str, full: tuple[int, ...], dim: int | None, tp_index: int, tp_size: int) -> list[Segment]:
    numel = 1
    for size in full:
        numel *= size
    if dim is None or tp_size == 1:
        return [Segment(0, name, 0, numel)]
    outer = 1
    for size in full[:dim]:
        outer *= size
    inner = numel // (outer * full[dim])
    local = full[dim] // tp_size * inner  # contiguous elements per outer index
    return [Segment(o * local, name, o * full[dim] * inner + tp_index * local, local) for o in range(outer)]


def owns_piece(lp_split: int | None, entry: Entry, groups: ParallelGroups) -> bool:
    """Whether this rank writes ``entry``'s pieces: one writer per range in the whole world."""
    return groups.replica_index == 0 and counts_across_model_parallel(lp_split, entry, groups)


def counts_across_model_parallel(lp_split: int | None, entry: Entry, groups: ParallelGroups) -> bool:
    """Whether this rank is the one of its tensor and pipeline groups that counts ``entry``'s
    pieces: on the stage that owns it (a tied weight's first), any tensor rank of a split one,
    tensor rank 0 of a replicated one."""
    return groups.pp_index == entry.owner_stage and (lp_split is not None or groups.tp_index == 0)


def gather_full(local: list[LocalParameter], local_buffers: dict[str, torch.Tensor],
                catalog: ParameterCatalog, groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """The dense state dict (every alias key), identical on every rank; collective."""
    held: dict[str, torch.Tensor] = {}
    for lp in local:
        tensor = lp.param.detach()
        if lp.split_dim is not None and groups.tp.world_size > 1:
            moved = tensor.movedim(lp.split_dim, 0).contiguous()
            tensor = groups.tp.all_gather(moved).movedim(0, lp.split_dim)
        held[lp.name] = tensor.clone()
    held.update({n: b.detach().clone() for n, b in local_buffers.items()})
    entries = catalog.params + catalog.buffers
    device = local[0].param.device if local else torch.device("cpu")
    for stage in range(groups.pp.world_size):
        mine = [e for e in entries if e.owner_stage == stage]
        for dtype in sorted({e.dtype for e in mine}, key=str):
            group = [e for e in mine if e.dtype == dtype]
            _broadcast_group(group, held, stage, groups, device)
    return {key: held[name] for key, name in catalog.state_keys}


def _broadcast_group(group: list[Entry], held: dict[str, torch.Tensor], stage: int,
                     groups: ParallelGroups, device: torch.device) -> None:
    sizes = [int(torch.Size(e.shape).numel()) for e in group]
    if groups.pp.world_size == 1:
        return
    if groups.pp_index == stage:
        flat = torch.cat([held[e.name].reshape(-1) for e in group])
    else:
        flat = torch.empty(sum(sizes), dtype=group[0].dtype, device=device)
    groups.pp.broadcast(flat, stage)
    offset = 0
    for e, size in zip(group, sizes):
        held[e.name] = flat[offset:offset + size].view(e.shape).clone()
        offset += size


def all_reduce_grads(params: list[torch.Tensor], group: ICommunicationBackend, op: ReduceOp,
                     keep_unused: bool = False) -> None:
    """One all_reduce per dtype of the flattened gradients (missing ones count as zeros).
    ``keep_unused`` (``find_unused_parameters``): one all_reduce(MAX) of a flag per parameter
    first, and a parameter without a gradient on every rank of ``group`` keeps ``.grad = None``."""
    if keep_unused and params:
        flags = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8,
                             device=params[0].device)
        group.all_reduce(flags, ReduceOp.MAX)
        params = [p for p, flag in zip(params, flags.tolist()) if flag]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for dtype in sorted(by_dtype, key=str):
        group_params = by_dtype[dtype]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in group_params])
        group.all_reduce(flat, op)
        offset = 0
        for p in group_params:
            piece = flat[offset:offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = piece.clone()
            else:
                p.grad.copy_(piece)
            offset += p.numel()


def zero_counted_segments(layout: ShardLayout, local: list[LocalParameter], catalog: ParameterCatalog,
                          groups: ParallelGroups) -> list[list[Segment]]:
    """The ranges of a ZeRO master chunk this rank adds to a global gradient norm. Chunks are
    disjoint over the data-parallel group; across the tensor and pipeline groups a replicated
    or tied range is counted once, by the rank ``owns_piece`` names (data-parallel index aside)."""
    split = {lp.name: lp.split_dim for lp in local}
    return [[s for s in segs if counts_across_model_parallel(split[s.name], catalog.by_name[s.name], groups)]
            for segs in layout.segments]
