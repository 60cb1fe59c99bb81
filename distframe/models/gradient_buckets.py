"""GradientBuckets: gradient hooks that start one collective per bucket during backward.

Shared by DDP, ZeRO-1 and ZeRO-2 (and usable over any backend or data-parallel subgroup).
Each parameter's ``.grad`` is a view into its bucket's flat buffer, so accumulation writes
straight into the buffer that is communicated. When every gradient of a bucket has been
accumulated, the bucket's collective is started asynchronously (``launch(bucket) -> Work``);
``finish()`` waits for them in bucket order and hands each result to ``complete(bucket, result)``;
a synchronising backward runs it as its last act (as torch DDP does), so gradients are averaged
when ``backward()`` returns, whoever steps: a plain torch.optim optimizer, clipping, a user.
Where that wait would stop peers from arriving (in-memory ranks sharing a GPU's autograd thread)
it moves to the rank's next optimizer step instead (``distframe.models.deferred_finish``).

[Note: launch order] Buckets are launched strictly in index order (a ready bucket waits for its
predecessors), and ``finish()`` launches whatever has not been launched yet, so every rank issues
the same collectives in the same order even when some parameters get no gradient on some ranks:
their slots of the buffer hold zeros and are reduced as zeros. No rank can hang on another.

[Note: gradients left local at the step] Backward passes that all ran unarmed (inside ``no_sync``,
or through a call the wrapper did not arm: a reentrant checkpoint, compiled code) leave their sum
in the buffers (or in ``accumulated``) with no synchronising backward after them; an optimizer step
took it as it was (DDP: each rank its own gradient, the replicas drifted apart) or never saw it
(ZeRO-1/2: only the reduced chunks reach the masters). ``finish(left_local=True)`` reduces that
sum as the synchronising backward would have: what a rank holds is re-attached (slots of gradients
cleared since read as zeros) and every bucket launched in order. The models'
``synchronize_gradients`` (every optimizer step, ``train_step``, ``clip_grad_norm_``) asks for it:
DDP's outside ``no_sync`` only (inside, its step takes each rank's own gradient, as torch DDP's does
and AsyncSGDOptimizer's workers need), ZeRO-1/2's always (their masters take reduced gradients
only). Whether any gradient arrived unarmed since the last reduction or ``zero_grad``
(``_left_local``), and whether a ``.grad`` is still held (a ``zero_grad`` that did not reach the
buckets: DDP's own, a plain optimizer's) depend only on the calls each rank made, which
``no_sync``'s contract makes the same on every rank: every rank takes the same path, so the
collectives pair up. (DDP's gradients are then each rank's own until the step: ``holds_left_local``
tells a plain GradScaler, whose check before the step would not agree, to refuse: see
``DDPModel.replicates_gradients``.)

[Note: buffers on first use] Without ``keep_buffers`` (ZeRO-2) a bucket that holds no gradient
gets its buffer when its first gradient arrives (the hook attaches it: that gradient is copied in,
its bucket-mates' ``.grad`` become zeroed views that autograd accumulates into in place), or at its
launch if none arrives, and loses it once its reduce_scatter completes. Attaching every bucket
before the forward, as DDP and ZeRO-1 do with the buffers they keep anyway, held the whole model's
gradients through forward and backward: ZeRO-2's peak was no lower than ZeRO-1's. A bucket with
a buffer (``no_sync`` accumulation) or a ``.grad`` is still attached before the forward, as before;
either way a bucket's ``has_gradient`` flags are set when it is attached, before its launch. Lazy
buffers alone bound nothing where the collectives lag behind backward (gloo on a few CPU cores: all
16 buffers of a 16-bucket MLP were alive at once), so a launch first waits for all but the latest
``RELEASED_IN_FLIGHT - 1`` reductions, as DeepSpeed's ZeRO-2 fills its two bucket buffers in turn
(``overlap_comm``): a rank holds its gradient shards and about three buckets of full gradients.
The wait is skipped where the peers it waits for share the calling thread (in-memory ranks on one
GPU, which could then never arrive); there the reductions run unbounded, as before. It waits only
for collectives this rank has launched, which every rank launches in the same order, so it cannot
hang on a peer that is itself waiting.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from distframe.backends.types import Work
from distframe.models import deferred_finish
from distframe.models.backward_end import BackwardEnd
from distframe.models.weak_hooks import weak_hook
from distframe.models.flat import FlatSpace
from distframe.models.parameter_usage import ParameterUsage
from distframe.precision import finer

#: Reduce-scatters of buffers freed once reduced (ZeRO-2) in flight at a time: [Note: buffers on first use].
RELEASED_IN_FLIGHT = 2


@dataclasses.dataclass
class GradBucket:
    """One bucket: its parameters' flat space and (while gradients are held) the flat buffer."""

    index: int
    space: FlatSpace
    buffer: torch.Tensor | None = None
    accumulated: torch.Tensor | None = None
    """Gradients of ``no_sync`` backwards summed in ``accumulate_dtype`` (see GradientBuckets)."""

    @property
    def parameters(self) -> list[nn.Parameter]:
        return self.space.params


LaunchFn = Callable[[GradBucket], Work]
CompleteFn = Callable[[GradBucket, Any], None]


class GradientBuckets:
    """Owns the buckets' gradient buffers and hooks; the strategy supplies what to communicate.

    ``grad_dtype``: dtype of the buffers (None: each bucket's parameter dtype).
    ``keep_buffers``: keep full gradients after synchronisation (DDP, ZeRO-1); False frees each
    bucket's buffer (and its parameters' ``.grad``) once its collective completes (ZeRO-2).
    ``usage`` (built by ``usage_for``) records which parameters hold a gradient: see
    ``ParameterUsage`` for what ``find_unused_parameters`` does with it.
    ``peers_on_thread``: the backend's ``peers_sharing_autograd_thread`` (the peers a wait on
    the calling thread would keep from arriving); None for a backend that has none.
    ``accumulate_dtype``: a dtype finer than ``grad_dtype`` (mixed precision: float32 over
    bfloat16 gradients) in which the gradients of ``no_sync`` backwards add up, as FSDP2 adds
    them up in its reduce dtype: each hook moves the parameter's gradient into the bucket's
    ``accumulated`` sum and zeroes its ``.grad``, and ``launch`` takes the sum with
    ``take_accumulated`` to add to what it reduces. Without it each micro-step's gradient was
    added to the others in bfloat16 (8 bits of mantissa), rounding the sum every time.
    """

    def __init__(self, spaces: list[FlatSpace], *, grad_dtype: torch.dtype | None, launch: LaunchFn,
                 complete: CompleteFn, keep_buffers: bool,
                 usage: Callable[[list[str], list[nn.Parameter]], ParameterUsage],
                 peers_on_thread: Callable[[], list[int]] | None = None,
                 accumulate_dtype: torch.dtype | None = None) -> None:
        self.buckets = [GradBucket(i, s) for i, s in enumerate(spaces)]
        self.grad_dtype = grad_dtype
        self.accumulate_dtype = accumulate_dtype if finer(accumulate_dtype, grad_dtype) else None
        self.launch_fn = launch
        self.complete_fn = complete
        self.keep_buffers = keep_buffers
        self._bucket_of: dict[int, tuple[GradBucket, int, int]] = {}
        self._first_index: list[int] = []
        entries = [e for bucket in self.buckets for e in bucket.space.entries]
        for bucket in self.buckets:
            self._first_index.append(len(self._bucket_of))
            for k, param in enumerate(bucket.parameters):
                self._bucket_of[id(param)] = (bucket, k, len(self._bucket_of))
        self.usage = usage([e.name for e in entries], [e.param for e in entries])
        self._armed = False
        self._left_local = False  # unarmed gradients arrived: [Note: gradients left local at the step]
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._next_launch = 0
        self._backward_end = BackwardEnd(self._finish_backward, only_if_accumulated=True)
        self._backward_finished = False
        self._peers_on_thread = peers_on_thread
        self._owner_thread = threading.current_thread()  # the rank's: the one that runs forward
        self._pending: list[tuple[GradBucket, Work]] = []
        self._handles = [p.register_post_accumulate_grad_hook(weak_hook(self._on_gradient_accumulated))
                         for bucket in self.buckets for p in bucket.parameters]

    # ---- life cycle --------------------------------------------------------------------------
    def prepare_for_backward(self, synchronize: bool) -> None:
        """Called before each forward that may be followed by backward: attaches each
        parameter's ``.grad`` to its slot of the bucket buffer (without ``keep_buffers``, of the
        buckets that hold gradients: see [Note: buffers on first use]); ``synchronize`` arms the hooks."""
        if self._next_launch or self._armed and self._backward_finished:
            self.finish()  # a backward ran without a step; keep the ranks' collectives aligned
        self._owner_thread = threading.current_thread()
        self._attach_held()
        self._armed = synchronize
        self._backward_finished = False
        self._backward_end.reset()  # a backward that raised never ran its callback
        self._ready = [set() for _ in self.buckets]

    def watch(self, output: Any) -> None:
        """Hooks a forward's ``output`` so that the backward from it finishes the reductions as
        its last act (``BackwardEnd``)."""
        if self._armed:
            self._backward_end.watch(output)

    def finish(self, *, left_local: bool = False) -> None:
        """Launches the buckets that have not been launched (in order), waits for all of them and
        completes each; a no-op when nothing was armed, unless ``left_local`` and unarmed backward
        passes left gradients to reduce ([Note: gradients left local at the step]). Runs the same
        collectives on every rank."""
        deferred_finish.discard(self._owner_thread, id(self))
        if left_local and not self._armed and not self._next_launch and self._left_local:
            self._armed = self._left_local = self.holds_left_local()
            if self._armed:
                self._attach_held()
        if not self._armed and not self._next_launch:
            return
        while self._next_launch < len(self.buckets):
            self._launch_next()
        flags = self.usage.start()
        self._complete_leading(block=True)
        self.usage.finish(flags)
        self._armed = self._left_local = False
        self._next_launch = 0

    def zero_grad(self) -> None:
        self._left_local = False
        for bucket in self.buckets:
            if bucket.buffer is not None:
                bucket.buffer.zero_()
            bucket.accumulated = None

    def release(self) -> None:
        self._left_local = False
        for bucket in self.buckets:
            self._release(bucket)
            bucket.accumulated = None

    def take_accumulated(self, bucket: GradBucket) -> torch.Tensor | None:
        """The bucket's ``no_sync`` gradients summed in ``accumulate_dtype`` (None: none), which
        the caller adds to the buffer it reduces; the bucket no longer holds them."""
        accumulated, bucket.accumulated = bucket.accumulated, None
        return accumulated

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- internals ---------------------------------------------------------------------------
    def _attach_held(self) -> None:
        """Attaches the buckets that hold gradients (every one with ``keep_buffers``)."""
        for bucket in self.buckets:
            if self.keep_buffers or bucket.buffer is not None or any(
                    p.grad is not None for p in bucket.parameters):
                self._attach(bucket)

    def holds_left_local(self) -> bool:
        """Whether unarmed backward passes left gradients that nothing reduced or cleared since."""
        return self._left_local and any(
            bucket.accumulated is not None or any(p.grad is not None for p in bucket.parameters)
            for bucket in self.buckets)

    def _attach(self, bucket: GradBucket) -> None:
        if bucket.buffer is None:
            dtype = self.grad_dtype or bucket.parameters[0].dtype
            bucket.buffer = torch.zeros(bucket.space.padded_numel, dtype=dtype,
                                        device=bucket.space.device)
        has_gradient = self.usage.has_gradient
        for i, (param, view) in enumerate(zip(bucket.parameters, bucket.space.views(bucket.buffer)),
                                          self._first_index[bucket.index]):
            grad = param.grad
            if grad is None:  # cleared (or never computed): no gradient until a hook gives one
                view.zero_()
                has_gradient[i] = False
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
                has_gradient[i] = True
            param.grad = view

    def _release(self, bucket: GradBucket) -> None:
        for param in bucket.parameters:
            param.grad = None
        bucket.buffer = None

    def _on_gradient_accumulated(self, param: nn.Parameter) -> None:
        bucket, k, i = self._bucket_of[id(param)]
        if bucket.buffer is None:
            self._attach(bucket)
        self.usage.has_gradient[i] = True
        view = bucket.space.view(bucket.buffer, k)
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            # The gradient was replaced (for example zero_grad(set_to_none=True) after forward).
            view.copy_(param.grad)
            param.grad = view
        if self._backward_finished or self._armed and bucket.index < self._next_launch:
            raise RuntimeError(
                f"a gradient arrived for bucket {bucket.index} after it was reduced: run one "
                "backward per forward, or accumulate inside model.no_sync()")
        if not self._armed:
            self._left_local = True  # see [Note: gradients left local at the step]
            if self.accumulate_dtype is not None:
                if bucket.accumulated is None:
                    bucket.accumulated = torch.zeros(bucket.space.padded_numel, dtype=self.accumulate_dtype,
                                                     device=bucket.space.device)
                bucket.space.view(bucket.accumulated, k).add_(view)
                view.zero_()
            return
        self._backward_end.gradient_accumulated()  # queues if no watched output did (a loss bypassing them)
        self._ready[bucket.index].add(k)
        while (self._next_launch < len(self.buckets) and len(self._ready[self._next_launch])
               == len(self.buckets[self._next_launch].parameters)):
            self._launch_next()

    def _finish_backward(self) -> None:
        if not self._armed:
            return
        peers = self._peers_on_thread() if self._peers_on_thread is not None else []
        if peers:
            deferred_finish.defer(self._owner_thread, id(self), self.finish, peers)
        else:
            self.finish()
        self._backward_finished = True

    def _complete_leading(self, *, block: bool, leave: int = 0) -> None:
        """Completes launched buckets in order: all but the last ``leave`` of them (``block``), or
        those whose collective has already finished, so ZeRO-2 frees full gradients during backward."""
        while len(self._pending) > leave and (block or self._pending[0][1].is_completed()):
            bucket, work = self._pending.pop(0)
            self.complete_fn(bucket, work.wait())
            if not self.keep_buffers:
                self._release(bucket)

    def _launch_next(self) -> None:
        self._complete_leading(block=False)
        if not self.keep_buffers and not (self._peers_on_thread and self._peers_on_thread()):
            self._complete_leading(block=True, leave=RELEASED_IN_FLIGHT - 1)  # [Note: buffers on first use]
        bucket = self.buckets[self._next_launch]
        if bucket.buffer is None:
            self._attach(bucket)
        self._pending.append((bucket, self.launch_fn(bucket)))
        self._next_launch += 1
