"""How HybridShardedModel cuts a model into pipeline stages: which layers each rank keeps.

With ``pp > 1`` the model's pipeline layers are partitioned into ``pp * virtual_stages`` global
stages (balanced by parameter count, or at ``split_points``); rank r of the pipeline group holds
``virtual_stages`` chunks, chunk c being global stage ``c * pp + r``. Without pipelining there are
no ranges (``None``) and the one chunk is the whole model. No communication happens here.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError
from distframe.mesh import ParallelDims
from distframe.models.stages import PipelineStage, layer_parameter_counts, partition, pipeline_layers
from distframe.models.tensor_parallel_plan import apply_tensor_parallel, default_tp_plan
from distframe.models.tensor_parallel_rng import TensorParallelRNG


def stage_ranges(model: nn.Module, dims: ParallelDims, virtual_stages: int,
                 split_points: Sequence[int] | None) -> list[range] | None:
    """Layer indices of each global stage, or None without pipelining."""
    if not dims.pp_enabled:
        if split_points is not None:
            raise ConfigError("split_points needs pipeline parallelism (pp > 1)")
        return None
    stages, counts = dims.pp * virtual_stages, layer_parameter_counts(pipeline_layers(model))
    if virtual_stages > 1 and len(counts) < stages:
        raise ConfigError(f"the model has {len(counts)} layers but pp={dims.pp} x virtual_stages="
                          f"{virtual_stages} stages were asked for; use virtual_stages <= "
                          f"{len(counts) // dims.pp} (each stage needs a layer)")
    return partition(counts, stages, split_points)


def chunk_layers(model: nn.Module, ranges: list[range], pp: int,
                 virtual_stages: int) -> list[list[list[nn.Module]]]:
    """``[rank][chunk] -> layers``: chunk c of rank r is global stage ``c * pp + r``."""
    layers = [m for _, m in pipeline_layers(model)]
    return [[[layers[i] for i in ranges[c * pp + r]] for c in range(virtual_stages)]
            for r in range(pp)]


def stage_layers(model: nn.Module, ranges: list[range] | None, pp: int,
                 virtual_stages: int) -> list[list[nn.Module]]:
    """``[rank] -> every layer the rank holds``."""
    if ranges is None:
        return [[model]]
    every_rank = [[layer for chunk in rank for layer in chunk]
                  for rank in chunk_layers(model, ranges, pp, virtual_stages)]
    _check_layers_hold_everything(model, every_rank)
    return every_rank


def _check_layers_hold_everything(model: nn.Module, every_rank: list[list[nn.Module]]) -> None:
    """ConfigError naming a parameter or buffer of ``model`` that no pipeline layer holds (one on
    a module that ``pipeline_layers()`` leaves out): no stage would hold or train it, and the
    dense state dict could not be put together."""
    held = {id(t) for layers in every_rank for layer in layers
            for t in (*layer.parameters(), *layer.buffers())}
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if id(tensor) not in held:
                raise ConfigError(f"{kind} {name!r} of {type(model).__name__} is in none of its pipeline "
                                  "layers, so no stage would hold it; make pipeline_layers() return every "
                                  "module that holds parameters or buffers (or move it into one of them)")


def apply_stage_tensor_parallel(model: nn.Module, tp_plan: Mapping[str, str] | None,
                                mine: list[nn.Module], tp_group: ICommunicationBackend,
                                rng: TensorParallelRNG | None) -> dict[int, int]:
    """The plan (None: the LM's default) applied to the modules of ``mine``, this rank's layers
    only; returns ``apply_tensor_parallel``'s map from each new parameter to its dense origin."""
    plan = default_tp_plan(model) if tp_plan is None else tp_plan
    owned = {id(m) for layer in mine for m in layer.modules()}
    return apply_tensor_parallel(model, tp_group, plan, include=lambda m: id(m) in owned, rng=rng)


def build_chunks(model: nn.Module, ranges: list[range] | None, pp: int, pp_index: int,
                 virtual_stages: int) -> list[nn.Module]:
    """This rank's chunks: the whole model without pipelining, else one PipelineStage a chunk."""
    if ranges is None:
        return [model]
    # Layers are looked up again: tensor parallelism replaced some of the modules.
    mine = chunk_layers(model, ranges, pp, virtual_stages)[pp_index]
    return [PipelineStage(layers, c * pp + pp_index, pp * virtual_stages) for c, layers in enumerate(mine)]


def cross_rank_buffers(every_rank: list[list[nn.Module]], rank: int,
                       names: dict[int, str]) -> list[tuple[str, torch.Tensor, list[int]]]:
    """``(name, buffer, pipeline ranks holding it)`` for each buffer of ``rank``'s layers that layers
    of another pipeline rank hold too (``names``: the dense model's, by id). Each rank keeps its own
    copy, so one changed in place stops being the one buffer the model has: ``PipelineRunner``
    refuses that (see [Note: buffers shared across stages] there)."""
    holders: dict[int, set[int]] = {}
    for r, layers in enumerate(every_rank):
        for layer in layers:
            for buffer in layer.buffers():
                holders.setdefault(id(buffer), set()).add(r)
    mine = {id(b): b for layer in every_rank[rank] for b in layer.buffers()}
    return [(names[key], buffer, sorted(holders[key])) for key, buffer in mine.items() if len(holders[key]) > 1]
