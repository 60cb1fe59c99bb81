"""Measuring a pipeline step: per-stage busy time (hence the bubble) and live activation memory.

``StepTimeline`` adds up the wall time of this stage's forward and backward compute; the rest of
the step (waiting to receive) is idle. ``ActivationMemoryMeter`` counts the storages autograd
saves for backward, through ``torch.autograd.graph.saved_tensors_hooks``: a storage is live from
its first save until autograd drops the last saved reference to it (after that micro-batch's
backward), each storage counted once by its data pointer, parameters and the input batch
excluded. The peak is the
activation memory the schedule really holds, not a count the scheduler keeps of itself.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn


@dataclasses.dataclass
class StepTimeline:
    """Wall times of one step on one stage (seconds); ``start_s``/``end_s`` are
    ``time.perf_counter()`` readings (CLOCK_MONOTONIC: comparable across processes of one host)."""

    busy_s: float = 0.0
    step_s: float = 0.0
    start_s: float = 0.0
    end_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0

    @property
    def idle_s(self) -> float:
        return max(0.0, self.step_s - self.busy_s)

    @property
    def bubble_fraction(self) -> float:
        return self.idle_s / self.step_s if self.step_s > 0 else 0.0

    @contextlib.contextmanager
    def busy(self, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.busy_s += elapsed
            if kind == "F":
                self.forward_s += elapsed
            else:
                self.backward_s += elapsed


def pipeline_bubble(timelines: Sequence[StepTimeline]) -> float:
    """Measured bubble of one step: the pipeline's span runs from the first stage's start to the
    last stage's end (every stage waits for the slowest before the optimizer step), and each
    stage's idle time is that span minus its busy time. Returns the mean idle fraction."""
    span = max(t.end_s for t in timelines) - min(t.start_s for t in timelines)
    if span <= 0:
        return 0.0
    return sum(max(0.0, span - t.busy_s) for t in timelines) / (span * len(timelines))


class _Saved:
    """What the pack hook stores in the graph; its death means autograd released the tensor."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationMemoryMeter:
    """Live and peak bytes of the (non-parameter) storages saved for backward while active.

    Off until ``enabled`` is set: the pack hook runs in Python for every tensor autograd saves
    (a few microseconds each, tens of them per block and micro-batch), which cost a pipeline of
    small blocks about 5% of its steps/s (BENCHMARKS.md, issue 6). While off, ``hooks()`` installs
    nothing and the counts stay zero."""

    def __init__(self, exclude: Iterable[torch.Tensor] = (), *, enabled: bool = False) -> None:
        self.enabled = enabled
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._step_excluded: set[int] = set()
        self._lock = threading.Lock()
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes

    def exclude(self, tensors: Iterable[object]) -> None:
        """Stops counting these tensors' storages until the next call (the step's input batch: the
        caller's memory, not the schedule's)."""
        self._step_excluded = {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}

    def hooks(self) -> contextlib.AbstractContextManager:
        """Context in which autograd's saved tensors are counted (nothing while not enabled)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._excluded or key in self._step_excluded:
            return tensor
        saved = _Saved(tensor)
        with self._lock:
            if self._refs.get(key, 0) == 0:
                self._sizes[key] = storage.nbytes()
                self.live_bytes += storage.nbytes()
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self._refs[key] = self._refs.get(key, 0) + 1
        weakref.finalize(saved, self._release, key)
        return saved

    def _release(self, key: int) -> None:
        with self._lock:
            self._refs[key] -= 1
            if self._refs[key] == 0:
                del self._refs[key]
                self.live_bytes -= self._sizes.pop(key)


def _unpack(packed: object) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Saved) else packed


class _FixedTime(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        time.sleep(seconds)
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class SleepStage(nn.Module):
    """A pipeline stage whose compute is a fixed wall time (forward ``seconds``, backward twice
    that), so a measured bubble depends on the schedule alone, not on how many cores the ranks
    share: what the bubble benchmark and test compare with (p-1)/(m+p-1)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return _FixedTime.apply(x * self.scale, self.seconds)
