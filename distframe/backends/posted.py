"""The post-first path of the synchronous all_reduce, all_gather and reduce_scatter.

[Note: post first] A synchronous call's bookkeeping (its sequence number, ``stats``, the progress
board) can wait until the transport is moving data. An engine that can start one of these
collectives on the caller's CPU tensors as they are (contiguous, a dtype it moves natively) sets
``_posts_first`` and does so in the ``_post_*`` hooks below; the bookkeeping then runs while the
peers' data is in flight. Python before a post is dear: after a 1 MB transfer has pushed the
interpreter's working set out of the caches it costs several times its warm time (BENCHMARKS.md,
issue 2), and every microsecond of it delays every peer.

``CommunicationBackendBase`` calls a hook only for a synchronous call outside ``debug`` mode,
with no asynchronous call pending (nor a failed one unreported, see ``async_calls``), on an open
backend, with a contiguous CPU input, after validating the arguments, so the errors, numbering
and ordering are those of the general path.
A hook returns a handle for ``_wait_posted``, or None when it cannot post this call (nothing has
happened then, and the call takes the general path).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from distframe.backends.call_slots import CallSlots
from distframe.backends.composed import call_tag
from distframe.backends.types import CommStats, ReduceOp


class PostedCollectives:
    """Mixed into CommunicationBackendBase; engines override the hooks and ``_wait_posted``."""

    _posts_first = False
    #: The engine compares every call's full signature itself (the in-memory rendezvous), so
    #: ``debug`` adds no exchange of its own.
    _compares_signatures = False
    _lock: threading.Lock
    _seq: int
    _pending: list
    _async_failure: str | None
    _closed: bool
    debug: bool
    stats: CommStats
    _check_open: Callable[[str], None]
    _check_signature: Callable[[Any], None]
    #: The same-node call slots (distframe.backends.call_slots), where the engine has them.
    _slots: CallSlots | None = None

    def _may_post(self, async_op: bool) -> bool:
        return self._posts_first and not (async_op or self.debug or self._pending or self._closed
                                          or self._async_failure is not None)

    def _post_all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Any:
        """Starts an in-place all_reduce with ``op`` (SUM, PRODUCT, MIN or MAX)."""
        return None

    def _post_all_gather(self, tensor: torch.Tensor, out: torch.Tensor) -> Any:
        """Starts an all_gather of ``tensor`` (at least 1-dim) into ``out``."""
        return None

    def _post_reduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor, op: ReduceOp) -> Any:
        """Starts a reduce_scatter of ``tensor`` into ``out`` (this rank's chunk)."""
        return None

    def _wait_posted(self, op: str, seq: int, handle: Any) -> None:
        """Records ``seq`` as reached (the progress board) and waits for the posted call, raising
        what the general path would (a timeout names ``op``, ``seq`` and the missing ranks)."""
        raise NotImplementedError(f"{type(self).__name__} posts calls but cannot wait for them")

    def _check_call(self, call: Any) -> None:
        """Compares ``call`` with the peers' before the engine issues it (general path, either
        way a call is run), raising CollectiveMismatchError: in ``debug`` mode the all-gathered
        signature, then the same-node call slots (``distframe.backends.call_slots``)."""
        if self.debug and not self._compares_signatures:
            self._check_signature(call)
        if self._slots is not None:
            signature = call.signature
            self._slots.announce(call.op, call.seq, signature.shape, signature.dtype, signature.args)

    def _posted(self, op: str, nbytes: int, described: tuple[Any, Any, Any], post: Callable[..., Any],
                *args: Any) -> bool:
        """Posts through ``post`` (a hook), numbers and counts the call, and waits for it; False
        when the hook declined. ``described``: the call's (shape, dtype, args) as its
        ``Signature`` gives them, for the call slots."""
        try:
            if self._slots is not None:
                # The hot path numbers its call after posting: this is the number it will get
                # (no other call can be numbered in between: no asynchronous call is pending).
                # A call the hook declines is announced again, the same, on the general path.
                shape, dtype, call_args = described
                self._slots.announce(op, self._seq + 1, shape, dtype, call_args + call_tag())
            handle = post(*args)
        except BaseException:
            self._count(op, nbytes)  # the peers may have posted theirs: keep the numbering in step
            raise
        if handle is None:
            return False
        self._wait_posted(op, self._count(op, nbytes), handle)
        return True

    def _count(self, op: str, nbytes: int) -> int:
        """Numbers and counts a call (any path; ValueError after ``shutdown``); returns its
        sequence number."""
        with self._lock:
            if self._closed:
                self._check_open(op)
            self._seq += 1
            self.stats.record_locked(op, nbytes)
            return self._seq
