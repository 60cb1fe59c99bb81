"""Executing a pipeline schedule on one rank: micro-batches, sends, receives, autograd.

``PipelineRunner.forward_backward`` runs this rank's action list (``pipeline_schedules``) for one
step. The rank holds one model chunk per virtual stage (one without interleaving); chunk c of
rank r is global stage ``g = c * p + r``, fed by global stage ``g - 1`` and feeding ``g + 1``.
A forward receives the activation from the previous stage (or takes the micro-batch input on
global stage 0), runs the chunk, and sends the output on (the last global stage applies
``loss_fn`` and scales it by ``1/m``, so the accumulated gradients are those of the mean loss over
the slice). A backward receives the output's gradient from the next stage (the last stage starts
from its loss), runs autograd through the chunk, and sends the input's gradient back. Parameter
gradients accumulate in ``.grad`` over the micro-batches. Collectives: besides the p2p of
``pipeline_comm``, one all_gather of a few integers per training step, by which the ranks agree
that they were given one batch ([Note: one batch per pipeline] in ``pipeline_one_batch``);
tensor-parallel layers inside a chunk run their own, in lockstep.
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError
from distframe.models.devices import module_device
from distframe.models.pipeline_one_batch import check_one_batch
from distframe.models.pipeline_comm import StageLinks
from distframe.models.pipeline_metrics import ActivationMemoryMeter, StepTimeline
from distframe.models.pipeline_outputs import concat_microbatches
from distframe.models.pipeline_schedules import max_in_flight, schedule_actions


class _ReceivedActivation(torch.autograd.Function):
    """The stage's input: the received activation ``x`` (a leaf whose ``.grad`` is sent back), as
    a tensor with a grad_fn, so a first layer may modify it in place (``nn.ReLU(inplace=True)``),
    which autograd forbids on a leaf that requires grad. It shares ``x``'s storage (no copy): the
    backward is the identity and needs no saved value."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _differentiable(tensor: torch.Tensor) -> bool:
    """Whether autograd can carry a gradient for ``tensor``'s dtype (floating point or complex)."""
    return tensor.is_floating_point() or tensor.is_complex()


def split_microbatches(tensor: Any, num_microbatches: int, what: str) -> list[Any]:
    """``tensor`` cut into ``num_microbatches`` equal pieces along dim 0."""
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"pipeline {what} must be one tensor (split along dim 0), got {type(tensor).__name__}")
    if tensor.dim() == 0:
        raise ConfigError(f"pipeline {what} are a 0-dim tensor: micro-batches are cut along dim 0, the "
                          f"batch dimension; give {what} one (e.g. {what}.reshape(1))")
    if tensor.shape[0] % num_microbatches:
        raise ConfigError(f"the batch of {tensor.shape[0]} {what} is not divisible by "
                          f"num_microbatches={num_microbatches}; make the per-rank batch a multiple of it")
    return list(tensor.chunk(num_microbatches, dim=0))


def warn_batch_norm_per_microbatch(chunks: Sequence[nn.Module], dense: nn.Module | None,
                                   num_microbatches: int) -> None:
    """Warns once (per stage) if ``chunks`` hold a BatchNorm and the batch is cut into micro-batches.

    Such a BatchNorm normalises each micro-batch by that micro-batch's mean and variance, and
    moves its running statistics once per micro-batch, so training differs from one process on
    the whole batch. GPipe and torch.distributed.pipelining do the same; exact whole-batch
    statistics would need every micro-batch's forward before any could go on, which is no
    pipeline. ``dense``, the model before it was cut, names the modules."""
    if num_microbatches == 1:
        return
    held = {id(m): m for c in chunks for m in c.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    if not held:
        return
    named = {id(m): name for name, m in (dense.named_modules() if dense is not None else ())}
    shown = ", ".join(f"{named.get(key, '?')!r} ({type(m).__name__})" for key, m in list(held.items())[:5])
    warnings.warn(
        f"num_microbatches={num_microbatches}: this pipeline stage's BatchNorm modules ({shown}"
        f"{', ...' if len(held) > 5 else ''}) normalise each micro-batch by its own statistics and "
        f"update their running statistics once per micro-batch, so training differs from one process "
        f"on the whole batch. Use num_microbatches=1 for whole-batch statistics, or a normalisation "
        f"that is per sample (LayerNorm, GroupNorm)", UserWarning, stacklevel=4)


def weights_tied_across_stages(chunks: Sequence[nn.Module],
                               dense: nn.Module) -> list[tuple[str, torch.Tensor, list[str]]]:
    """``(name, parameter, its names elsewhere)`` for each parameter of ``chunks`` (this rank's)
    that a module of ``dense`` (the model they were cut from) outside them holds too: a weight
    tied to a layer of another pipeline rank, which holds a copy of its own."""
    here = {id(m) for chunk in chunks for m in chunk.modules()}
    mine = {id(p): p for chunk in chunks for p in chunk.parameters()}
    names: dict[int, list[str]] = {}
    elsewhere: dict[int, list[str]] = {}
    for module_name, module in dense.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False):
            if id(param) in mine:
                name = f"{module_name}.{attr}" if module_name else attr
                (names if id(module) in here else elsewhere).setdefault(id(param), []).append(name)
    return [(names.get(key, others)[0], mine[key], others) for key, others in elsewhere.items()]


class PipelineRunner:
    """Rank ``backend.rank`` of a pipeline over ``backend``, holding ``chunks`` (its model chunks,
    in chunk order; global stage of chunk c is ``c * p + rank``)."""

    def __init__(self, chunks: Sequence[nn.Module], backend: ICommunicationBackend, *, num_microbatches: int,
                 schedule: str, dense: nn.Module | None = None,
                 shared_buffers: Sequence[tuple[str, torch.Tensor, list[int]]] = ()) -> None:
        warn_batch_norm_per_microbatch(chunks, dense, num_microbatches)
        self.shared_buffers = [(name, b, b._version, ranks) for name, b, ranks in shared_buffers]
        self.tied_weights = weights_tied_across_stages(chunks, dense) if dense is not None else []
        self.chunks, self.backend = list(chunks), backend
        self.num_microbatches, self.schedule = num_microbatches, schedule
        self.ranks = backend.world_size
        self.num_stages = self.ranks * len(self.chunks)
        self.actions = schedule_actions(schedule, self.ranks, backend.rank, num_microbatches, len(self.chunks))
        self.links = StageLinks(backend, device=module_device(*self.chunks))
        self.memory = ActivationMemoryMeter(exclude=[p for c in self.chunks for p in c.parameters()])
        self.timeline = StepTimeline()
        self.in_flight_peak = max_in_flight(self.actions)

    @property
    def is_first(self) -> bool:
        """Whether this rank feeds the model its inputs (holds global stage 0)."""
        return self.backend.rank == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank computes the loss (holds the last global stage)."""
        return self.backend.rank == self.ranks - 1

    def _stage(self, chunk: int) -> int:
        return chunk * self.ranks + self.backend.rank

    def _rank_of(self, stage: int) -> int:
        return stage % self.ranks

    def forward_backward(self, inputs: Any, targets: Any, loss_fn: Callable) -> torch.Tensor | None:
        """Runs the step; returns the mean loss over the slice on the last rank, else None."""
        if not torch.is_grad_enabled():
            raise ConfigError("a pipeline training step ran with autograd off (torch.no_grad or "
                              "inference_mode): it would train nothing. Call train_step/forward_backward "
                              "with grad enabled; evaluate with the model's forward or validation_loss")
        m = self.num_microbatches
        micro_inputs, micro_targets, refused = [None] * m, [None] * m, None
        try:
            if self.is_first:
                micro_inputs = split_microbatches(inputs, m, "inputs")
            if self.is_last:
                micro_targets = split_microbatches(targets, m, "targets")
        except ConfigError as exc:  # raised after the check, which tells the other ranks
            refused = exc
        check_one_batch(self.backend, inputs, targets, refused=refused, device=self.links.device)
        self.links.new_step(m)
        self.timeline = StepTimeline()
        self.memory.exclude([inputs, targets])
        self.memory.reset_peak()
        held: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        losses = []
        versions = [p._version for _, p, _ in self.tied_weights]
        start = time.perf_counter()
        for action in self.actions:
            key = (action.chunk, action.microbatch)
            if action.kind == "F":
                x, out = self._forward(action.chunk, micro_inputs[action.microbatch], grad=True,
                                       microbatch=action.microbatch)
                if self._stage(action.chunk) == self.num_stages - 1:
                    with self.timeline.busy("F", action.chunk, action.microbatch), self.memory.hooks():
                        out = loss_fn(out, micro_targets[action.microbatch]) / m
                    if not out.requires_grad:
                        raise ConfigError(
                            "the pipeline's loss does not require grad: it does not depend on the "
                            "model's output through autograd (detached, argmax?); one process's "
                            "loss.backward() raises here too")
                    losses.append(out.detach())
                held[key] = (x, out)
            else:
                x, out = held.pop(key)
                self._backward(action.chunk, x, out, action.microbatch)
        self.links.wait_sends()
        self._close_timeline(start)
        self._check_shared_buffers()
        self._check_tied_weights(versions)
        return torch.stack(losses).sum() if self.is_last else None

    def _check_shared_buffers(self) -> None:
        """[Note: buffers shared across stages] A buffer that layers on two pipeline ranks share
        (one tensor registered twice) is one copy per rank here: a constant one is exact, one
        changed in place (a running statistic, a counter) is updated by each rank's layers on its
        own copy and stops being the model's one buffer, and checkpoints keep one of the copies.
        Refused after the step that changes it (a version counter moved), on that rank."""
        for name, buffer, version, ranks in self.shared_buffers:
            if buffer._version != version:
                raise ConfigError(
                    f"buffer {name!r} is shared by layers on pipeline ranks {' and '.join(map(str, ranks))}, "
                    "each of which holds its own copy, and this step changed it in place: the copies "
                    "part. Put the layers that share it on one stage (split_points), or give each "
                    "layer a buffer of its own")

    def _check_tied_weights(self, versions: list[int]) -> None:
        """[Note: weights tied across stages changed in place] A weight tied across stages (an
        embedding and its head) is one copy per rank holding it, kept equal by summing their
        gradients (``TiedGradients``) and stepping them alike. A forward that changes its copy in
        place (``nn.Embedding(max_norm=...)`` renormalises the rows it looks up) changes that copy
        only: the other stages compute with the stale one, and the pipeline trains another model
        than one process, silently. Refused after the step (or evaluation) that did it (the
        version counter moved since ``versions``), on the rank whose copy changed; its peers, left
        waiting for it, stop with RankFailedError. A tied weight that tensor parallelism splits is
        not watched: its layers change nothing in place (a 'vocab' embedding refuses max_norm)."""
        for (name, param, elsewhere), version in zip(self.tied_weights, versions):
            if param._version != version:
                raise ConfigError(
                    f"parameter {name!r} is tied to {', '.join(map(repr, elsewhere))}, which another "
                    "pipeline rank holds: each rank holds its own copy, and the forward changed this "
                    "rank's copy in place (as nn.Embedding(max_norm=...) renormalises the rows it looks "
                    "up), so the copies part and the pipeline would train another model than one "
                    "process. Untie the weights, drop the in-place change from the forward (max_norm="
                    "None), or keep the layers that share the weight on one stage (split_points)")

    def forward_only(self, inputs: Any) -> Any:
        """Forward of every micro-batch without autograd; on the last rank the outputs joined
        along dim 0 (leaf by leaf for a tuple, list or dict: ``pipeline_outputs``), else None.
        The timeline then describes this pass."""
        m = self.num_microbatches
        micro_inputs = split_microbatches(inputs, m, "inputs") if self.is_first else [None] * m
        self.links.new_step(m)
        self.timeline = StepTimeline()
        outputs = []
        versions = [p._version for _, p, _ in self.tied_weights]
        start = time.perf_counter()
        with torch.no_grad():
            # Chunk-major order is a valid schedule: stage g only waits for stage g - 1.
            for chunk in range(len(self.chunks)):
                for i in range(m):
                    out = self._forward(chunk, micro_inputs[i], grad=False, microbatch=i)[1]
                    if self._stage(chunk) == self.num_stages - 1:
                        outputs.append(out)
        self.links.wait_sends()
        self._close_timeline(start)
        self._check_shared_buffers()
        self._check_tied_weights(versions)
        return concat_microbatches(outputs) if self.is_last else None

    def _close_timeline(self, start: float) -> None:
        self.timeline.start_s, self.timeline.end_s = start, time.perf_counter()
        self.timeline.step_s = self.timeline.end_s - start

    def _forward(self, chunk: int, micro_input: Any, grad: bool,
                 microbatch: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        stage = self._stage(chunk)
        if stage == 0:
            x = micro_input
        else:
            x = self.links.recv_activation(self._rank_of(stage - 1), stage)
        stage_input = x
        if stage > 0 and grad and _differentiable(x):
            stage_input = _ReceivedActivation.apply(x.requires_grad_(True))
        with self.timeline.busy("F", chunk, microbatch), self.memory.hooks():
            out = self.chunks[chunk](stage_input)
        if stage < self.num_stages - 1:
            if not isinstance(out, torch.Tensor):
                raise ConfigError(f"pipeline stage {stage} returned a {type(out).__name__}; a stage passes "
                                  "one tensor to the next: make its last layer return one tensor")
            self.links.send_activation(out, self._rank_of(stage + 1), stage + 1)
            if grad and out.requires_grad:
                self.links.expect_gradient(out, self._rank_of(stage + 1), stage)
        return (x if stage > 0 else None), out

    def _backward(self, chunk: int, x: torch.Tensor | None, out: torch.Tensor, microbatch: int) -> None:
        stage = self._stage(chunk)
        # The next stage sends back the gradient of every floating-point or complex input it
        # receives (it sets requires_grad on those, see _forward); an integer activation (token
        # ids) has none.
        last = stage == self.num_stages - 1
        grad_out = (None if last or not _differentiable(out)
                    else self.links.recv_gradient(out, self._rank_of(stage + 1), stage))
        with self.timeline.busy("B", chunk, microbatch):
            # No gradient came back: the next stage's output does not depend on this one's (see
            # [Note: inputs that get no gradient] in pipeline_comm), so nothing here gets one.
            if out.requires_grad and (last or grad_out is not None):
                torch.autograd.backward(out, grad_out)
        if x is not None and x.requires_grad:
            self.links.send_gradient(x.grad, x, self._rank_of(stage - 1), stage - 1)
