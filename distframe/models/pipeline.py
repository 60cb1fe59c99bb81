"""PipelineParallelModel: a model cut into stages, one per rank of the backend.

Rank s holds stage s's parameters only (and its optimizer state, with a plain torch.optim
optimizer over ``model.parameters()``). ``train_step`` splits this rank's slice into
``num_microbatches`` equal micro-batches and runs GPipe or 1F1B (``pipeline_schedules``):
activations go forward and their gradients backward with isend/recv between neighbouring ranks;
the last stage computes the loss, which is broadcast over the group, so every rank returns the
same mean loss. A weight tied across stages (the LM's embedding and head) is held by both and its
gradient all-reduced between them. ``last_timeline`` and ``activation_memory`` report the
measured busy/idle time and peak saved-activation bytes (when enabled) of the last step on
this stage.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.mesh import ParallelDims
from distframe.models.hybrid import HybridShardedModel
from distframe.models.pipeline_metrics import ActivationMemoryMeter, StepTimeline


class PipelineParallelModel(HybridShardedModel):
    """``PipelineParallelModel(model, backend, *, num_microbatches, schedule="1f1b" | "gpipe" |
    "interleaved_1f1b", split_points=None, virtual_stages=1)``; ``model``: an ``nn.Sequential``, a
    list of blocks, a ``DilatedTransformerLM`` or a module with ``pipeline_layers()`` (see
    ``stages``). ``interleaved_1f1b`` cuts the model into ``pp * virtual_stages`` stages and gives
    rank r the chunks ``r, r + pp, ...``; ``split_points`` then has ``pp * virtual_stages - 1``
    entries. ``named_parameters()`` names the stage's own modules (``wrapped_model.layers.<i>``,
    numbered from 0 on every stage, unlike torch.distributed.pipelining, which keeps the model's
    names): pick parameters by the unwrapped model's names with ``dense_named_parameters()``."""

    def __init__(self, model: nn.Module | Sequence[nn.Module], backend: ICommunicationBackend, *,
                 num_microbatches: int, schedule: str = "1f1b", split_points: Sequence[int] | None = None,
                 virtual_stages: int = 1, **settings: Any) -> None:
        super().__init__(model, backend, dims=ParallelDims(pp=backend.world_size),
                         num_microbatches=num_microbatches, schedule=schedule,
                         split_points=split_points, virtual_stages=virtual_stages, **settings)

    @property
    def stage_index(self) -> int:
        return self.groups.pp_index

    @property
    def last_timeline(self) -> StepTimeline:
        """Busy, idle and step wall time of this stage in the last step."""
        return self.runner.timeline if self.runner is not None else StepTimeline()

    @property
    def activation_memory(self) -> ActivationMemoryMeter:
        """Live and peak bytes of saved-for-backward storage on this stage, counted from the next
        step on once ``activation_memory.enabled = True`` (off by default: it costs time)."""
        return self.runner.memory if self.runner is not None else ActivationMemoryMeter()
