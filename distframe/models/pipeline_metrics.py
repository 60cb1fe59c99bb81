"""Measuring a pipeline step: per-stage busy time (hence the bubble) and live activation memory.

``StepTimeline`` adds up the wall time of this stage's forward and backward compute; the rest of
the step (waiting to receive) is idle. It also keeps each operation's interval (``ops``), from
which ``replayed_bubble`` rebuilds the step as it would have run with the same compute times and
free messages: the formula's bubble assumes equal, fixed times per micro-batch, the replay uses
the measured ones, so measured against replayed is what messages and scheduling overhead cost, and
replayed against the formula what unequal or varying compute times cost.

``ActivationMemoryMeter`` counts the storages autograd saves for backward, through
``torch.autograd.graph.saved_tensors_hooks``: a storage is live from its first save until
autograd drops the last saved reference to it (after that micro-batch's backward), each storage
counted once by its data pointer, parameters and the input batch excluded. The peak is the
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

    step_s: float = 0.0
    start_s: float = 0.0
    end_s: float = 0.0
    ops: list[tuple[str, int, int, float, float]] = dataclasses.field(default_factory=list)
    """(kind, chunk, micro-batch, start, end) of each compute interval, in the order run."""

    def _total(self, kinds: str) -> float:
        return sum(end - start for kind, _, _, start, end in self.ops if kind in kinds)

    @property
    def busy_s(self) -> float:
        return self._total("FB")

    @property
    def forward_s(self) -> float:
        return self._total("F")

    @property
    def backward_s(self) -> float:
        return self._total("B")

    @property
    def idle_s(self) -> float:
        return max(0.0, self.step_s - self.busy_s)

    @property
    def bubble_fraction(self) -> float:
        return self.idle_s / self.step_s if self.step_s > 0 else 0.0

    @contextlib.contextmanager
    def busy(self, kind: str, chunk: int = 0, microbatch: int = -1) -> Iterator[None]:
        """Times one compute interval: ``kind`` "F" or "B" of ``microbatch`` on model ``chunk``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.ops.append((kind, chunk, microbatch, start, time.perf_counter()))


def pipeline_bubble(timelines: Sequence[StepTimeline]) -> float:
    """Measured bubble of one step: the pipeline's span runs from the first stage's start to the
    last stage's end (every stage waits for the slowest before the optimizer step), and each
    stage's idle time is that span minus its busy time. Returns the mean idle fraction."""
    span = max(t.end_s for t in timelines) - min(t.start_s for t in timelines)
    if span <= 0:
        return 0.0
    return sum(max(0.0, span - t.busy_s) for t in timelines) / (span * len(timelines))


def replayed_bubble(timelines: Sequence[StepTimeline]) -> float:
    """The bubble of the same step rebuilt with each operation's measured compute time and messages
    that cost nothing: every operation starts as soon as its rank finished the one before it and
    its input exists (forward of global stage g after that micro-batch's forward on g - 1,
    backward on g after its backward on g + 1; chunk c of rank r is global stage c * p + r).
    ``timelines`` holds one step's timeline per pipeline rank, in rank order. With equal times
    per micro-batch this is (p-1)/(m+p-1) exactly (or (p-1)/(v*m+p-1) interleaved)."""
    p = len(timelines)
    queues = []  # per rank: [(kind, stage, micro-batch, duration)], intervals of one op merged
    for rank, timeline in enumerate(timelines):
        ops: list[list] = []
        for kind, chunk, microbatch, start, end in timeline.ops:
            stage = chunk * p + rank
            if ops and ops[-1][:3] == [kind, stage, microbatch]:
                ops[-1][3] += end - start  # the last stage's loss belongs to its forward
            else:
                ops.append([kind, stage, microbatch, end - start])
        queues.append(ops)
    last_stage = max((op[1] for ops in queues for op in ops), default=0)
    done: dict[tuple[str, int, int], float] = {}
    clock, position = [0.0] * p, [0] * p
    while any(position[r] < len(queues[r]) for r in range(p)):
        progressed = False
        for rank in range(p):
            while position[rank] < len(queues[rank]):
                kind, stage, microbatch, duration = queues[rank][position[rank]]
                feeder = stage - 1 if kind == "F" else stage + 1
                needs = (kind, feeder, microbatch) if 0 <= feeder <= last_stage else None
                if needs is not None and needs not in done:
                    break
                start = max(clock[rank], done[needs] if needs is not None else 0.0)
                clock[rank] = done[(kind, stage, microbatch)] = start + duration
                position[rank] += 1
                progressed = True
        if not progressed:
            raise ValueError("the timelines' operations cannot all run: they are not one step's "
                             "schedule over these ranks")
    span = max(clock)
    if span <= 0:
        return 0.0
    return sum(span - sum(op[3] for op in ops) for ops in queues) / (span * p)


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
