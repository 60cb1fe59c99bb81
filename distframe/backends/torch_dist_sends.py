"""The sends of the torch.distributed engines that have not been seen to complete: Gloo's buffered
``send`` returns at once (``torch_dist_engine``, [Note: point to point]), so the engine holds each
send's work and payload until it completes, and a shutdown finishes them, dropping those to a rank
that left without receiving them (``departures``, [Note: sends to a rank that left])."""
from __future__ import annotations

import collections
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from distframe.backends.departures import Departure, send_departure_error
from distframe.backends.torch_dist_board import _CUT, WAIT_SLICE

#: An unfinished send: (work, the buffer it reads, receiver, user tag, message number on the channel).
PendingSend = tuple[Any, torch.Tensor, int, int, int]


class UnfinishedSends:
    """The sends of one group that have not been seen to complete, each with the buffer it
    reads, kept until they do. NCCL's report completion by themselves; a Gloo send only to a
    wait (``waited``), made by a thread of its own (``SendWaiter``), started at the first send."""

    def __init__(self, *, waited: bool) -> None:
        self._waited = waited
        self._sends: list[PendingSend] = []
        self._waiter: SendWaiter | None = None

    def add(self, send: PendingSend) -> None:
        if not self._waited:
            self._sends = [s for s in self._sends if not s[0].is_completed()]
            self._sends.append(send)
            return
        if self._waiter is None:
            self._waiter = SendWaiter()
        self._waiter.add(send)

    def held(self) -> int:
        """How many sends (with their buffers) are held now."""
        return len(self._waiter.remaining()) if self._waiter is not None else len(self._sends)

    def close(self) -> None:
        """The group is garbage (``shutdown`` calls ``finish`` instead): no more sends come, and
        the waiter's thread ends once it has waited for those it holds."""
        if self._waiter is not None:
            self._waiter.close()

    def finish(self, sender: int, timeout: float,
               departures: Callable[[], dict[int, Departure]]) -> None:
        """At shutdown: ``finish_sends`` for the sends still unfinished."""
        waiter = self._waiter if self._waiter is not None else SendWaiter(self._sends)
        self._waiter, self._sends = None, []
        finish_sends(waiter, sender, timeout, departures)


def finish_sends(waiter: SendWaiter, sender: int, timeout: float,
                 departures: Callable[[], dict[int, Departure]]) -> None:
    """Waits up to ``timeout`` seconds for the unfinished sends of rank ``sender``'s group that
    shuts down (those ``waiter`` has not seen complete; it takes no more). Drops with a
    RuntimeWarning those to a rank that left without posting their receive (``departures()`` is
    asked every ``WAIT_SLICE`` once the wait has lasted that long) and those still unfinished at
    the timeout. A Gloo wait that times out aborts every operation of the group, so the sends are
    waited for on a thread of their own (``SendWaiter``), and the dropped ones are cut only once
    no other send is waited for."""
    waiter.close()
    start = time.monotonic()
    dropped: list[PendingSend] = []
    while True:
        waiter.join(WAIT_SLICE.total_seconds())
        if not waiter.is_alive():
            break
        now = time.monotonic()
        pending = waiter.remaining()
        if now - start >= timeout:
            dropped += _warn(pending, f"did not receive them within the timeout ({timeout:g} s)")
            break
        departed = departures()
        lost = [send for send in pending if send_departure_error(
            departed.get(send[2]), send[2], sender, send[3], send[4], now - start) is not None]
        if not lost:
            continue
        dropped += _warn(lost, "left the group without receiving them")
        lost_ids = {id(send) for send in lost}
        waiter.dropped |= lost_ids
        if id(pending[0]) in lost_ids:  # the waiter is stuck on it until the cut: go on without it
            waiter.stopped = True
            waiter = SendWaiter([send for send in pending if id(send) not in lost_ids])
            waiter.close()
    for work, *_ in dropped:  # abandoned as a timed-out wait would abandon it
        try:
            work.wait(_CUT)
        except RuntimeError:
            pass


class SendWaiter(threading.Thread):
    """Waits for the sends queued to it (``add``) one after another, skipping those ``dropped``
    meanwhile, and forgets each, with the buffer it holds, once complete: a wait is the only way
    to see that a Gloo send has completed (its ``is_completed`` stays False until one), so
    without this thread every payload a rank sent stayed in memory until its shutdown. It must be
    a send's only waiter (a second wait on a completed Gloo send never returns). ``close()``: no
    more sends come; the thread ends once it has waited for those it holds."""

    def __init__(self, sends: list[PendingSend] = ()) -> None:
        super().__init__(name="distframe-sends", daemon=True)
        self._cond = threading.Condition()
        self._sends: collections.deque[PendingSend] = collections.deque(sends)
        self._closed = False
        self.dropped: set[int] = set()
        self.stopped = False
        self.start()

    def add(self, send: PendingSend) -> None:
        with self._cond:
            self._sends.append(send)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def run(self) -> None:
        while True:
            with self._cond:
                while not self._sends and not self._closed:
                    self._cond.wait()
                if self.stopped or not self._sends:
                    return
                send = self._sends[0]
            if id(send) not in self.dropped:
                try:
                    send[0].wait()
                except RuntimeError:  # the receiver's connections closed: nothing to deliver to
                    pass
            del send  # an idle thread holds no work: one keeps its process group, and sockets, alive
            with self._cond:
                self._sends.popleft()

    def remaining(self) -> list[PendingSend]:
        """The send waited for now and those after it, less those dropped."""
        with self._cond:
            return [send for send in self._sends if id(send) not in self.dropped]


def _warn(sends: list[PendingSend], why: str) -> list[PendingSend]:
    """Says which messages of ``sends`` a shutdown drops, by channel; returns ``sends``."""
    messages: dict[tuple[int, int], set[int]] = {}
    for _, _, dst, tag, seq in sends:
        messages.setdefault((dst, tag), set()).add(seq)
    for (dst, tag), seqs in sorted(messages.items()):
        count = f"{len(seqs)} message{'s' if len(seqs) > 1 else ''}"
        warnings.warn(f"shutdown dropped {count} with tag {tag} to rank {dst} (numbers {sorted(seqs)} on "
                      f"that channel): rank {dst} {why}", RuntimeWarning, stacklevel=5)
    return sends
