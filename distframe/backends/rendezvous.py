"""Where the threads of the in-memory engine meet: one rendezvous per group, one world per spawn.

A collective call is a *slot* keyed by the group's sequence number, so a fast rank that has
already moved on to call n+1 can never mix its buffers into call n. A slot has two meeting points:
``arrive`` (every rank has posted its input and its signature, which must agree) and ``depart``
(every rank has finished reading the others' inputs, so each may return and reuse its buffers).
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import Any

from distframe.backends.signature import Signature, describe_mismatch
from distframe.errors import CollectiveMismatchError, CollectiveTimeoutError, RankFailedError


class World:
    """State shared by every group of one set of in-memory ranks: whether a rank has failed."""

    def __init__(self) -> None:
        self.failed_rank: int | None = None
        self.failure: BaseException | None = None
        self._groups: weakref.WeakSet[Rendezvous] = weakref.WeakSet()
        self._lock = threading.Lock()

    def register(self, group: Rendezvous) -> None:
        with self._lock:
            self._groups.add(group)

    def abort(self, global_rank: int, error: BaseException) -> None:
        """Marks ``global_rank`` failed and wakes every waiting rank so it raises RankFailedError."""
        with self._lock:
            if self.failure is None:
                self.failed_rank, self.failure = global_rank, error
            groups = list(self._groups)
        for group in groups:
            with group.cond:
                group.cond.notify_all()

    def check(self) -> None:
        if self.failure is not None:
            raise RankFailedError(self.failed_rank, f"{type(self.failure).__name__}: {self.failure}")


class Slot:
    """One collective call of one group."""

    def __init__(self) -> None:
        self.signatures: dict[int, Signature] = {}
        self.inputs: dict[int, Any] = {}
        self.shared: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.departed: set[int] = set()


class Rendezvous:
    """The meeting place of one group: ``size`` ranks, known globally as ``global_ranks``."""

    def __init__(self, world: World, global_ranks: list[int]) -> None:
        self.world = world
        self.global_ranks = list(global_ranks)
        self.size = len(global_ranks)
        self.cond = threading.Condition()
        self._slots: dict[int, Slot] = {}
        self._mailboxes: dict[tuple[int, int, int], deque] = {}
        world.register(self)

    # ---- collectives -------------------------------------------------------------------------
    def arrive(self, rank: int, seq: int, signature: Signature, payload: Any, timeout: float) -> Slot:
        """Posts this rank's input; returns the slot once every rank has posted a matching one."""
        deadline = time.monotonic() + timeout
        self.world.check()  # a new call after a known failure stops at once
        with self.cond:
            slot = self._slots.setdefault(seq, Slot())
            if slot.error is None:
                mismatch = next((r for r, s in slot.signatures.items() if s != signature), None)
                if mismatch is not None:
                    texts = {r: s.describe() for r, s in slot.signatures.items()}
                    texts[rank] = signature.describe()
                    slot.error = CollectiveMismatchError(signature.op, seq, describe_mismatch(texts))
            slot.signatures[rank] = signature
            slot.inputs[rank] = payload
            self.cond.notify_all()
            self._wait(lambda: len(slot.inputs) == self.size or slot.error is not None, deadline,
                       timeout, signature.op, seq, lambda: set(range(self.size)) - set(slot.inputs))
            if slot.error is not None:
                raise slot.error
            return slot

    def depart(self, rank: int, seq: int, slot: Slot, op: str, timeout: float) -> None:
        """Waits until every rank is done with this slot's inputs, then frees the slot."""
        deadline = time.monotonic() + timeout
        with self.cond:
            slot.departed.add(rank)
            if len(slot.departed) == self.size:
                self._slots.pop(seq, None)
                self.cond.notify_all()
                return
            self._wait(lambda: len(slot.departed) == self.size, deadline, timeout, op, seq,
                       lambda: set(range(self.size)) - slot.departed)

    def compute_once(self, slot: Slot, key: str, make: Any) -> Any:
        """The first rank to ask computes ``make()``; every rank gets the same object."""
        with self.cond:
            if key not in slot.shared:
                slot.shared[key] = make()
            return slot.shared[key]

    # ---- point to point ----------------------------------------------------------------------
    def post(self, src: int, dst: int, tag: int, item: Any) -> None:
        with self.cond:
            self._mailboxes.setdefault((src, dst, tag), deque()).append(item)
            self.cond.notify_all()

    def has_message(self, src: int, dst: int, tag: int) -> bool:
        with self.cond:
            return bool(self._mailboxes.get((src, dst, tag)))

    def take(self, src: int, dst: int, tag: int, seq: int, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        with self.cond:
            box = self._mailboxes.setdefault((src, dst, tag), deque())
            self._wait(lambda: bool(box), deadline, timeout, "recv", seq, lambda: {src})
            return box.popleft()

    # ---- waiting -----------------------------------------------------------------------------
    def _wait(self, ready, deadline: float, timeout: float, op: str, seq: int, missing) -> None:
        """Waits on the condition (held) until ``ready()``; raises on timeout or a peer's failure."""
        while not ready():
            self.world.check()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                absent = missing()
                raise CollectiveTimeoutError(
                    op, seq, None if absent is None else sorted(absent), timeout,
                    self._global_note(absent))
            # Wake at least once a second: a peer failure notifies us, this is only a backstop.
            self.cond.wait(min(remaining, 1.0))
        # No failure check once ready: a call that completed is not undone by a peer failing
        # afterwards; this rank learns of the failure at its next wait.

    def _global_note(self, absent) -> str:
        if not absent or self.global_ranks == list(range(self.size)):
            return ""
        return f"global ranks {[self.global_ranks[r] for r in sorted(absent)]}"

