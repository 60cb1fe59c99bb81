"""Asynchronous calls (``async_op=True``): one communication thread per backend runs them, one at a
time, in issue order (``[Note: ordering]`` in ``base.py``).

[Note: after a failed asynchronous call] The calls queued behind a failed one are not run: each
ends at once with an error that names the failed call. Running them would cost each its own
timeout when a peer is gone, and any that still ran when the next synchronous call reported the
failure would run beside whatever the caller did next, out of issue order. So the next
synchronous call waits for every earlier asynchronous call (which, after a failure, takes no
longer than the failed one) and raises the first failure; from then on calls run again. So do
the asynchronous calls issued after a ``Work.wait()`` that raised the failure (or the refusal of
a call queued behind it): the caller has seen it, and nothing is queued behind it any more (they
were refused as queued behind it, which only a synchronous call cleared). Every rank learns of a
failure at its own pace, so a group whose call failed may be out of step: what the error says to
do (rebuild the group, or stop) still applies. The error of a call that was not run is a copy of
the failure's (``queued_behind``): its class and fields, which callers act on, with a message that
names the call first.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from distframe.backends import cuda_streams
from distframe.backends.composed import Call
from distframe.backends.types import FutureWork
from distframe.errors import DistFrameError, rebuild_exception


class AsyncCalls:
    """Mixed into CommunicationBackendBase: the communication thread and the calls pending on it."""

    engine: str
    debug: bool
    _rank: int
    _lock: threading.Lock
    _executor: ThreadPoolExecutor | None
    _pending: list[Future]
    #: "op (sequence number n) failed (error)" for the first asynchronous call that failed since
    #: the last synchronous call; set and read on the communication thread, cleared by ``_drain``
    #: or by the first call issued after a wait that saw it ([Note: after a failed asynchronous
    #: call]). ``_failed_seq``: that call's sequence number; ``_failure_seen_at``: the last one
    #: issued when a wait saw it (None until then). All three under ``_lock``.
    _async_failure: str | None
    _async_error: BaseException | None = None  # that call's error
    _failed_seq: int = 0
    _failure_seen_at: int | None = None
    _seq: int
    _check_call: Callable[[Call], None]
    _stall_check: Callable[[Call], Callable[[], BaseException | None] | None]

    def _missing_ranks(self, seq: int) -> list[int] | None:
        """The ranks of this group that have not entered call ``seq`` (this one included while the
        call waits its turn here), for an expired ``Work.wait(timeout=...)``; None where the
        engine cannot tell. Engines override it."""
        return None

    def _ranks_in_world(self) -> list[int] | None:
        """The world rank of each rank of this group, None where the group numbers them as the
        world does ([Note: ranks of the world] in ``departures``). Engines keep it as
        ``_world_ranks``; the in-memory engine overrides this."""
        return getattr(self, "_world_ranks", None)

    def _submit(self, call: Call, fn: Callable[[Call], Any]) -> FutureWork:
        """Queues ``fn(call)`` on the communication thread, under the caller's current CUDA
        stream ([Note: the caller's stream] in ``cuda_streams``)."""
        stream = cuda_streams.caller_stream()

        def execute() -> Any:
            failure = self._failure_before(call.seq)
            if failure is not None:
                raise queued_behind(call, *failure)
            try:
                self._check_call(call)
                return fn(call) if stream is None else cuda_streams.run_on(stream, fn, call)
            except BaseException as exc:
                with self._lock:
                    self._failed_seq, self._failure_seen_at, self._async_error = call.seq, None, exc
                    self._async_failure = (f"{call.op} (sequence number {call.seq}), issued before it "
                                           f"with async_op=True, failed ({type(exc).__name__}: {exc})")
                raise
        future = self._communication_thread().submit(execute)
        with self._lock:
            self._pending.append(future)
        # A call that succeeded has nothing left for _drain to re-raise: forget it at once, so
        # its result (a gathered tensor, say) lives only as long as the caller keeps it.
        future.add_done_callback(self._forget_if_succeeded)
        return FutureWork(future, call.op, call.seq, on_done=lambda: self._waited(future, call.seq),
                          stall=self._stall_check(call), missing=lambda: self._missing_ranks(call.seq),
                          world_ranks=self._ranks_in_world())

    def _failure_before(self, seq: int) -> tuple[str, BaseException] | None:
        """The failure that call ``seq`` is queued behind (its text and error), None to run it:
        none, or one that a wait saw before ``seq`` was issued (then cleared)."""
        with self._lock:
            if self._async_failure is not None and self._failure_seen_at is not None and (
                    seq > self._failure_seen_at):
                self._async_failure = self._failure_seen_at = self._async_error = None
            return None if self._async_failure is None else (self._async_failure, self._async_error)

    def _waited(self, future: Future, seq: int) -> None:
        """A wait on call ``seq`` has returned or raised: a failure it raised (the call's own, or
        its refusal behind the current failure) has been seen by the caller, so the calls issued
        from now on run ([Note: after a failed asynchronous call])."""
        self._forget(future)
        if future.done() and not future.cancelled() and future.exception() is not None:
            with self._lock:
                if self._async_failure is not None and self._failed_seq <= seq and (
                        self._failure_seen_at is None):  # the first wait that saw it counts
                    self._failure_seen_at = self._seq

    def _communication_thread(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    1, thread_name_prefix=f"distframe-{self.engine}-rank{self._rank}")
            return self._executor

    def _forget(self, future: Future) -> None:
        with self._lock:
            if future in self._pending:
                self._pending.remove(future)

    def _forget_if_succeeded(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self._forget(future)

    def _drain(self) -> None:
        """Waits for every asynchronous call issued earlier and re-raises the first failure among
        them (``[Note: after a failed asynchronous call]``)."""
        with self._lock:
            pending = list(self._pending)
        first: BaseException | None = None
        for future in pending:
            error = future.exception()  # waits; after a failure, the queued calls end at once
            self._forget(future)
            if first is None:
                first = error
        with self._lock:  # nothing issued before this call is left running
            self._async_failure = self._failure_seen_at = self._async_error = None
        if first is not None:
            raise first


def queued_behind(call: Call, failure: str, error: BaseException) -> BaseException:
    """The error of ``call``, not run because it was queued behind a failed asynchronous call
    (``failure``: that call and its error, which was ``error``). A copy of ``error``, of its class
    and with its fields, because callers act on them: a launcher re-raises the original exception
    of the rank that failed rather than its peers' RankFailedErrors, and an elastic run drops the
    ranks that a CollectiveTimeoutError names. A ZeRO-3 backward waits for a prefetched all_gather
    queued behind a reduce_scatter before it waits for that, so a plain DistFrameError there passed
    a peer's failure off as this rank's own. Only the message changes, to name this call first."""
    text = (f"{call.op} (sequence number {call.seq}) was not run: {failure}, and the calls queued "
            "behind a failed asynchronous call are not run")
    if isinstance(error, Exception) and len(error.args) == 1 and isinstance(error.args[0], str):
        try:
            attributes = {k: v for k, v in vars(error).items() if k != "__notes__"}
            copy = rebuild_exception(type(error), (text,), attributes)
        except Exception:  # noqa: BLE001 - a class that cannot be rebuilt: the plain error below
            pass
        else:
            copy.__cause__ = error
            return copy
    queued = DistFrameError(text)
    queued.__cause__ = error
    return queued
