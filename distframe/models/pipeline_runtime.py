"""Executing a pipeline schedule on one stage: micro-batches, sends, receives, autograd.

``PipelineRunner.forward_backward`` runs this stage's action list (``pipeline_schedules``) for one
step. A forward receives the activation from the previous stage (or takes the micro-batch input
on the first stage), runs the stage, and sends the output on (the last stage applies
``loss_fn`` and scales it by ``1/m``, so the accumulated gradients are those of the mean loss over
the slice). A backward receives the output's gradient from the next stage (the last stage starts
from its loss), runs autograd through the stage, and sends the input's gradient back. Parameter
gradients accumulate in ``.grad`` over the micro-batches. Collectives: none besides the p2p of
``pipeline_comm`` (tensor-parallel layers inside the stage run their own, in lockstep).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError
from distframe.models.pipeline_comm import StageLinks
from distframe.models.pipeline_metrics import ActivationMemoryMeter, StepTimeline
from distframe.models.pipeline_schedules import max_in_flight, schedule_actions
from distframe.models.stages import PipelineStage


def split_microbatches(tensor: Any, num_microbatches: int, what: str) -> list[Any]:
    """``tensor`` cut into ``num_microbatches`` equal pieces along dim 0."""
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"pipeline {what} must be one tensor (split along dim 0), got {type(tensor).__name__}")
    if tensor.shape[0] % num_microbatches:
        raise ConfigError(f"the batch of {tensor.shape[0]} {what} is not divisible by "
                          f"num_microbatches={num_microbatches}; make the per-rank batch a multiple of it")
    return list(tensor.chunk(num_microbatches, dim=0))


class PipelineRunner:
    """One stage of a pipeline over ``backend`` (the pipeline group: rank = stage index)."""

    def __init__(self, stage: PipelineStage, backend: ICommunicationBackend, *, num_microbatches: int,
                 schedule: str) -> None:
        self.stage, self.backend = stage, backend
        self.num_microbatches, self.schedule = num_microbatches, schedule
        self.actions = schedule_actions(schedule, backend.world_size, backend.rank, num_microbatches)
        self.links = StageLinks(backend)
        self.memory = ActivationMemoryMeter(exclude=list(stage.parameters()))
        self.timeline = StepTimeline()
        self.in_flight_peak = max_in_flight(self.actions)

    @property
    def is_first(self) -> bool:
        return self.backend.rank == 0

    @property
    def is_last(self) -> bool:
        return self.backend.rank == self.backend.world_size - 1

    def forward_backward(self, inputs: Any, targets: Any, loss_fn: Callable) -> torch.Tensor | None:
        """Runs the step; returns the mean loss over the slice on the last stage, else None."""
        m = self.num_microbatches
        micro_inputs = split_microbatches(inputs, m, "inputs") if self.is_first else [None] * m
        micro_targets = split_microbatches(targets, m, "targets") if self.is_last else [None] * m
        self.links.new_step()
        self.timeline = StepTimeline()
        self.memory.exclude([inputs, targets])
        self.memory.reset_peak()
        held: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        losses = []
        start = time.perf_counter()
        for action in self.actions:
            i = action.microbatch
            if action.kind == "F":
                x, out = self._forward(micro_inputs[i], grad=True)
                if self.is_last:
                    with self.timeline.busy("F"), self.memory.hooks():
                        out = loss_fn(out, micro_targets[i]) / m
                    losses.append(out.detach())
                held[i] = (x, out)
            else:
                x, out = held.pop(i)
                self._backward(x, out)
        self.links.wait_sends()
        self.timeline.start_s, self.timeline.end_s = start, time.perf_counter()
        self.timeline.step_s = self.timeline.end_s - start
        return torch.stack(losses).sum() if self.is_last else None

    def forward_only(self, inputs: Any) -> torch.Tensor | None:
        """Forward of every micro-batch without autograd; the concatenated output on the last stage."""
        m = self.num_microbatches
        micro_inputs = split_microbatches(inputs, m, "inputs") if self.is_first else [None] * m
        self.links.new_step()
        outputs = []
        with torch.no_grad():
            for i in range(m):
                outputs.append(self._forward(micro_inputs[i], grad=False)[1])
        self.links.wait_sends()
        return torch.cat(outputs) if self.is_last else None

    def _forward(self, micro_input: Any, grad: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        if self.is_first:
            x = micro_input
        else:
            x = self.links.recv_activation()
            if grad and x.is_floating_point():
                x.requires_grad_(True)
        with self.timeline.busy("F"), self.memory.hooks():
            out = self.stage(x)
        if not self.is_last:
            self.links.send_activation(out)
        return (x if not self.is_first else None), out

    def _backward(self, x: torch.Tensor | None, out: torch.Tensor) -> None:
        grad_out = None if self.is_last else self.links.recv_gradient(out)
        with self.timeline.busy("B"):
            if out.requires_grad:
                torch.autograd.backward(out, grad_out)
        if x is not None and x.requires_grad:
            grad = x.grad if x.grad is not None else torch.zeros_like(x)
            self.links.send_gradient(grad)

