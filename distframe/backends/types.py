"""Value types every engine shares: reduction ops, pending work and communication counters."""
from __future__ import annotations

import enum
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from distframe.backends.departures import world_note
from distframe.backends.validation import check_wait_timeout
from distframe.errors import CollectiveTimeoutError


class ReduceOp(enum.Enum):
    """Reduction applied by ``all_reduce``, ``reduce`` and ``reduce_scatter`` (torch.distributed names)."""

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            try:
                return cls[op.upper()]
            except KeyError:
                pass
        raise ValueError(f"op must be a ReduceOp (SUM, AVG, PRODUCT, MIN, MAX), got {op!r}")


# Dtypes torch has no CPU arithmetic for (float8; unsigned wider than 8 bits): no engine can
# reduce them alike (MPI could add uint16, the others cannot), so every engine refuses.
UNREDUCIBLE = frozenset(getattr(torch, name) for name in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "uint16", "uint32", "uint64") if hasattr(torch, name))


def effective_op(op: ReduceOp, dtype: torch.dtype) -> ReduceOp:
    """The op actually applied for ``dtype``: bool SUM is logical OR and PRODUCT logical AND,
    as in torch.distributed; AVG needs a floating or complex dtype, MIN and MAX a real one (they
    raised torch's own error mid-call: from ``reduce`` on rank ``dst`` only, the others returning);
    ``UNREDUCIBLE`` dtypes are moved (all_gather, broadcast, ...) but never reduced."""
    if dtype in UNREDUCIBLE:
        wider = "torch.float32" if dtype.is_floating_point else "torch.int64"
        raise ValueError(f"a {op.name} reduction of {dtype}: torch has no arithmetic for this dtype, so "
                         f"no engine reduces it; reduce a {wider} copy (t.to({wider})) and convert back")
    if dtype == torch.bool:
        if op is ReduceOp.AVG:
            raise ValueError("ReduceOp.AVG is undefined for bool tensors; use MAX (any) or MIN (all)")
        return {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PRODUCT: ReduceOp.MIN}.get(op, op)
    if dtype.is_complex and op in (ReduceOp.MIN, ReduceOp.MAX):
        # Else MPI raised its raw "Invalid MPI_Op" error stack, the others torch's RuntimeError.
        raise ValueError(f"ReduceOp.{op.name} is undefined for {dtype}: complex numbers have no order; "
                         "reduce torch.view_as_real(t) for the parts, or t.abs() for the magnitudes")
    if op is ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"ReduceOp.AVG needs a floating dtype, got {dtype}; "
                         "use ReduceOp.SUM and divide, or convert to a float dtype first")
    return op


class Work:
    """A pending operation. ``wait()`` blocks until it completes and returns its result
    (the output tensor, list of tensors, or None), raising what the operation raised.

    ``stop_on_departure``: a receive whose sender left without sending its message stops at once
    (``distframe.backends.departures``). On Gloo that takes closing the group's connections, so a
    caller that checks departures itself and goes on using the group (the parameter server) sets
    it False on its receives before waiting; they then wait for their timeout."""

    stop_on_departure: bool = True

    def wait(self, timeout: float | None = None) -> Any:
        raise NotImplementedError

    def is_completed(self) -> bool:
        raise NotImplementedError


class CompletedWork(Work):
    """Work that finished when it was created (a synchronous call returned through ``async_op``)."""

    def __init__(self, result: Any = None) -> None:
        self._result = result

    def wait(self, timeout: float | None = None) -> Any:
        check_wait_timeout(timeout)
        return self._result

    def is_completed(self) -> bool:
        return True


class FutureWork(Work):
    """Work running on a backend's communication thread.

    ``stall``, if given, is asked once a second while ``wait`` blocks: an error it returns (the
    operation can never complete) is raised at once instead of waiting on. ``missing``, if given,
    names the ranks that have not entered the operation when ``wait(timeout=...)`` expires
    (None where the engine cannot tell), and ``world_ranks`` what the world numbers them."""

    def __init__(self, future: Future, op: str, seq: int, on_done: Callable[[], None] | None = None,
                 stall: Callable[[], BaseException | None] | None = None,
                 missing: Callable[[], list[int] | None] | None = None,
                 world_ranks: list[int] | None = None) -> None:
        self._world_ranks = world_ranks
        self._future = future
        self._op = op
        self._seq = seq
        self._on_done = on_done
        self._stall = stall
        self._missing = missing

    def wait(self, timeout: float | None = None) -> Any:
        timeout = check_wait_timeout(timeout)
        stalled = False
        try:
            result = self._result(timeout)
        except FutureTimeout as error:
            stalled = isinstance(error, CollectiveTimeoutError) and not self._future.done()
            if self._future.done() or isinstance(error, CollectiveTimeoutError):
                raise  # the operation's own timeout (its error names the missing ranks) or a stall
            missing = None if self._missing is None else self._missing()
            detail = "Work.wait(timeout=...) expired before the operation completed"
            if missing == []:
                missing, detail = None, f"{detail}; every rank has entered it"
            detail = world_note(missing, self._world_ranks) + detail
            raise CollectiveTimeoutError(self._op, self._seq, missing, timeout or 0.0, detail) from None
        finally:
            # A failure the caller has now seen is not raised again by the next call, nor by
            # shutdown: a stall says the operation can never complete, so its later failure
            # (the peers being aborted) is the same one.
            if self._on_done is not None and (self._future.done() or stalled):
                self._on_done()
        return result

    def _result(self, timeout: float | None) -> Any:
        if self._stall is None:
            return self._future.result(timeout=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            try:
                return self._future.result(timeout=1.0 if left is None else max(0.0, min(1.0, left)))
            except FutureTimeout:
                if self._future.done() or (left is not None and left <= 1.0):
                    raise
            stalled = self._stall()
            if stalled is not None:
                raise stalled

    def is_completed(self) -> bool:
        return self._future.done()


class CommStats:
    """Per-op counters of one backend object: ``calls[op]`` and ``bytes[op]``, where bytes are those
    of the tensors this rank handed to ``op`` (its input; for ``scatter`` on the source, all chunks).
    Wire volume follows from the op and the world size."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self._lock = threading.Lock()

    def record(self, op: str, nbytes: int) -> None:
        with self._lock:  # send and recv are counted from any thread
            calls, sent = self.calls, self.bytes
            calls[op] = calls.get(op, 0) + 1
            sent[op] = sent.get(op, 0) + nbytes

    def record_locked(self, op: str, nbytes: int) -> None:
        """``record`` for a caller that already serialises its records (a backend's collectives,
        under the backend's lock); ``send``/``recv``, counted from any thread, use ``record``.
        The two never count the same op."""
        calls, sent = self.calls, self.bytes
        calls[op] = calls.get(op, 0) + 1
        sent[op] = sent.get(op, 0) + nbytes

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def total_calls(self) -> int:
        return sum(self.calls.values())

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.bytes.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {"calls": dict(self.calls), "bytes": dict(self.bytes)}

    def __repr__(self) -> str:
        return f"CommStats(calls={dict(self.calls)}, bytes={dict(self.bytes)})"
