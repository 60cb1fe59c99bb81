"""Where the threads of the in-memory engine meet: one rendezvous per group, one world per spawn.

A collective call is a *slot* keyed by the group's sequence number, so a fast rank that has
already moved on to call n+1 can never mix its buffers into call n. A slot has two meeting points:
``arrive`` (every rank has posted its input and its signature, which must agree) and ``depart``
(every rank has finished reading the others' inputs, so each may return and reuse its buffers).
A rank that will make no further call here (its function under ``spawn`` returned, or it shut
its backend down) is not waited for: peers stop at once (``distframe.backends.departures``).
"""
from __future__ import annotations

import copy
import threading
import time
import weakref
from typing import Any

import torch

from distframe.backends.cuda_streams import cuda_devices
from distframe.backends.departures import (Departure, departure_error, gave_up_error, in_world,
                                           receive_departure_error, world_note, world_ranks_of)
from distframe.backends.signature import Signature, describe_mismatch
from distframe.errors import CollectiveMismatchError, CollectiveTimeoutError, RankFailedError

# [Note: ranks sharing a GPU, waiting inside backward]
# torch runs the backward functions of one GPU on one autograd worker thread for the whole
# process, whichever thread called backward. In-memory ranks are threads of one process, so when
# two of them use the same GPU and one waits for the other inside backward (ZeRO-3/FSDP unshard,
# tensor-parallel all-reduce, ring attention's key exchange), the other's backward is queued
# behind the waiter on that same thread and never arrives. A wait that is still unmet after
# STALL_GRACE seconds, on that worker thread, for a rank that has used this GPU, therefore stops
# at once with an error that says so, instead of at the timeout.
STALL_GRACE = 1.0


def autograd_device() -> int | None:
    """The CUDA device whose autograd worker thread this is; None on any other thread."""
    if torch._C._current_graph_task_id() == -1 or not torch.cuda.is_initialized():
        return None
    if not isinstance(threading.current_thread(), getattr(threading, "_DummyThread", ())):
        return None  # a thread Python started: backward of CPU tensors runs on the caller's
    return torch.cuda.current_device()


def shared_gpu_note(op: str, device: int, ranks: list[int]) -> str:
    return (f"this rank waits in {op} inside backward on torch's autograd thread for cuda:{device}, "
            f"which ranks {ranks} also use: torch runs their backward on this same thread, so "
            "they cannot arrive. In-memory ranks that communicate inside backward (ZeRO-3, FSDP, "
            "tensor parallelism, ring attention) need a GPU each, or one process per GPU "
            "(backend='nccl')")


class World:
    """State shared by every group of one set of in-memory ranks: whether a rank has failed, and
    which ranks have finished (their function under ``spawn`` has returned)."""

    def __init__(self) -> None:
        self.failed_rank: int | None = None
        self.failure: BaseException | None = None
        self.gpus: dict[int, set[int]] = {}  # global rank -> CUDA devices it has communicated on
        self.finished: set[int] = set()  # global ranks that can never make another call
        # Global ranks whose function has ended and whose backends ``finish`` shuts down: their
        # departures are named as a return (``Rendezvous._finished_error``) once it is done.
        self.leaving: set[int] = set()
        self._groups: weakref.WeakSet[Rendezvous] = weakref.WeakSet()
        self._backends: dict[int, weakref.WeakSet] = {}  # global rank -> its backends, any group
        self.enlisted: set[int] = set()  # every global rank that has had a backend here
        self._lock = threading.Lock()

    def note_gpus(self, global_rank: int, payload: Any) -> None:
        devices = cuda_devices(payload)
        if devices and not devices <= self.gpus.get(global_rank, set()):
            with self._lock:
                self.gpus[global_rank] = self.gpus.get(global_rank, set()) | devices

    def ranks_on_gpu(self, device: int, global_ranks) -> list[int]:
        return sorted(r for r in global_ranks if device in self.gpus.get(r, ()))

    def register(self, group: Rendezvous) -> None:
        with self._lock:
            self._groups.add(group)

    def enlist(self, global_rank: int, backend: Any) -> None:
        """Records a backend of ``global_rank`` (of any group), for ``finish``."""
        with self._lock:
            self._backends.setdefault(global_rank, weakref.WeakSet()).add(backend)
            self.enlisted.add(global_rank)

    def abort(self, global_rank: int, error: BaseException) -> None:
        """Marks ``global_rank`` failed and wakes every waiting rank so it raises RankFailedError."""
        with self._lock:
            if self.failure is None:
                self.failed_rank, self.failure = global_rank, error
        self._wake_all()

    def finish(self, global_rank: int) -> None:
        """Called when ``global_rank``'s function has ended: shuts its backends down, subgroups
        included (each first waits for its asynchronous calls), after which the rank can never
        make a call again; peers waiting for it then stop at once (``Rendezvous._wait``). Raises
        the first failure a shutdown raised (an asynchronous call whose failure was not seen)."""
        with self._lock:
            self.leaving.add(global_rank)
            backends = list(self._backends.pop(global_rank, ()))
        failure: BaseException | None = None
        for backend in backends:
            try:
                backend.shutdown()
            except BaseException as exc:  # noqa: BLE001 - the others still shut down; raised below
                failure = failure or exc
        with self._lock:
            self.finished.add(global_rank)
        self._wake_all()
        if failure is not None:  # an asynchronous call of the rank's that failed unseen
            raise failure

    def _wake_all(self) -> None:
        with self._lock:
            groups = list(self._groups)
        for group in groups:
            group.wake_all()

    def check(self) -> None:
        if self.failure is not None:
            raise RankFailedError(self.failed_rank, f"{type(self.failure).__name__}: {self.failure}")


class Slot:
    """One collective call of one group."""

    def __init__(self) -> None:
        self.signatures: dict[int, Signature] = {}
        self.inputs: dict[int, Any] = {}
        self.shared: dict[str, Any] = {}
        self.error: CollectiveMismatchError | None = None
        self.departed: set[int] = set()  # ranks done with it: they left the call or raised its error


class Rendezvous:
    """The meeting place of one group: ``size`` ranks, known globally as ``global_ranks``."""

    def __init__(self, world: World, global_ranks: list[int]) -> None:
        self.world = world
        self.global_ranks = list(global_ranks)
        self.world_ranks = world_ranks_of(self.global_ranks)  # [Note: ranks of the world] in departures
        self.size = len(global_ranks)
        lock = threading.RLock()
        self.cond = threading.Condition(lock)
        # One condition per receiving rank, on the same lock: a message wakes its receiver only,
        # not every rank of the group that waits for something else (a ring step at world 4 and
        # 8 about 40% less, set against a plain thread handoff: BENCHMARKS.md).
        self._inboxes = [threading.Condition(lock) for _ in range(self.size)]
        self._slots: dict[int, Slot] = {}
        # (src, dst, tag) -> {message number on that channel: (number, payload)}
        self._mailboxes: dict[tuple[int, int, int], dict[int, Any]] = {}
        self._freed_through = 0  # the highest sequence number whose slot is done and freed
        self.departures: dict[int, Departure] = {}  # ranks whose backend here has shut down
        # rank -> (op, seq, missing ranks, timeout) of the collective it gave up on at its timeout:
        # the group's calls from there on can never complete ([Note: after a timeout] in call_slots)
        self.gave_up: dict[int, tuple[str, int, list[int] | None, float]] = {}
        world.register(self)

    # ---- collectives -------------------------------------------------------------------------
    def arrive(self, rank: int, seq: int, signature: Signature, payload: Any, timeout: float) -> Slot:
        """Posts this rank's input; returns the slot once every rank has posted a matching one."""
        deadline = time.monotonic() + timeout
        self.world.check()  # a new call after a known failure stops at once
        self.world.note_gpus(self.global_ranks[rank], payload)
        with self.cond:
            given_up = self._given_up_error(rank, signature.op, seq)
            if given_up is not None:  # before posting: no peer may complete this call with it
                raise given_up
            slot = self._slots.setdefault(seq, Slot())
            if slot.error is None:
                mismatch = next((r for r, s in slot.signatures.items() if s != signature), None)
                if mismatch is not None:
                    texts = {r: s.describe() for r, s in slot.signatures.items()}
                    texts[rank] = signature.describe()
                    slot.error = CollectiveMismatchError(signature.op, seq, describe_mismatch(texts))
                    # No rank reads the inputs of a failed call: let go of them now, not when
                    # the last rank (which may be late, or never come) has seen the error.
                    slot.inputs.clear()
            slot.signatures[rank] = signature
            if slot.error is None:
                slot.inputs[rank] = payload
            self.cond.notify_all()
            self._wait(lambda: len(slot.signatures) == self.size or slot.error is not None, deadline,
                       timeout, signature.op, seq, lambda: set(range(self.size)) - set(slot.signatures),
                       rank=rank)
            if slot.error is not None:
                slot.departed.add(rank)
                if len(slot.departed) == self.size:  # every rank has seen the error
                    self._free(seq)
                # A copy each: raising one object on every thread chained each raise's traceback
                # onto it, so each rank's error kept the frames (and inputs) of those before it.
                raise copy.copy(slot.error)
            return slot

    def depart(self, rank: int, seq: int, slot: Slot, op: str, timeout: float) -> None:
        """Waits until every rank is done with this slot's inputs, then frees the slot."""
        deadline = time.monotonic() + timeout
        with self.cond:
            slot.departed.add(rank)
            if len(slot.departed) == self.size:
                self._free(seq)
                return
            self._wait(lambda: len(slot.departed) == self.size, deadline, timeout, op, seq,
                       lambda: set(range(self.size)) - slot.departed, rank=rank)

    def _free(self, seq: int) -> None:
        """Forgets collective ``seq`` (the lock held): every rank is done with it."""
        self._slots.pop(seq, None)
        self._freed_through = max(self._freed_through, seq)
        self.cond.notify_all()

    def compute_once(self, slot: Slot, key: str, make: Any) -> Any:
        """The first rank to ask computes ``make()``; every rank gets the same object."""
        with self.cond:
            if key not in slot.shared:
                slot.shared[key] = make()
            return slot.shared[key]

    # ---- point to point ----------------------------------------------------------------------
    # Messages are numbered per (src, dst, tag) channel by sender and receiver alike, and receive
    # number k takes message k: receives match in the order they were posted (MPI's
    # non-overtaking rule), whichever of them is waited for first.
    def post(self, src: int, dst: int, tag: int, seq: int, payload: Any) -> None:
        self.world.note_gpus(self.global_ranks[src], payload)
        with self.cond:
            self._mailboxes.setdefault((src, dst, tag), {})[seq] = (seq, payload)
            self._inboxes[dst].notify_all()

    def has_message(self, src: int, dst: int, tag: int, seq: int) -> bool:
        with self.cond:
            return seq in self._mailboxes.get((src, dst, tag), ())

    def take(self, src: int, dst: int, tag: int, seq: int, timeout: float) -> Any:
        """Message ``seq`` of the channel, once it has been posted. A receive that stops without
        it says what ``src`` did send ``dst`` under other tags (``_other_tags_note``)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            box = self._mailboxes.setdefault((src, dst, tag), {})
            try:
                self._wait(lambda: seq in box, deadline, timeout, "recv", seq, lambda: {src},
                           channel=(src, dst, tag))
            except CollectiveTimeoutError as exc:
                note = self._other_tags_note(src, dst, tag)
                if not note:
                    raise
                *named, detail, early = exc._args  # op, seq, missing ranks, seconds waited
                raise CollectiveTimeoutError(*named, f"{detail}; {note}" if detail else note,
                                             early) from None
            return box.pop(seq)

    def _other_tags_note(self, src: int, dst: int, tag: int) -> str:
        """The messages from ``src`` to ``dst`` waiting under tags other than ``tag`` (the lock
        held), as a hint that the receive asked for the wrong tag; "" when there are none."""
        waiting = {t: len(box) for (s, d, t), box in self._mailboxes.items()
                   if s == src and d == dst and t != tag and box}
        if not waiting:
            return ""
        counts = " and ".join(f"{n} message{'s' if n > 1 else ''} with tag {t}"
                              for t, n in sorted(waiting.items()))
        tags = " or ".join(f"tag {t}" for t in sorted(waiting))
        return f"rank {src} sent this rank {counts} that no receive has taken yet: did you mean {tags}?"

    # ---- waiting -----------------------------------------------------------------------------
    def wake_all(self) -> None:
        """Wakes every rank waiting here, in a collective or a receive, to look again."""
        with self.cond:
            for cond in (self.cond, *self._inboxes):
                cond.notify_all()

    def _wait(self, ready, deadline: float, timeout: float, op: str, seq: int, missing,
              channel: tuple[int, int, int] | None = None, rank: int | None = None) -> None:
        """Waits on the condition (held) until ``ready()``; raises on timeout or a peer's failure,
        or at once when the missing ranks cannot arrive (they left the group, or ``[Note: ranks
        sharing a GPU, ...]``) or, in a collective (``rank`` given: the waiting rank), once a
        rank has given up on it. A receive gives its ``channel``: (source, receiver, tag)."""
        cond = self.cond if channel is None else self._inboxes[channel[1]]
        start = time.monotonic()
        while not ready():
            self.world.check()
            if rank is not None and self.gave_up:
                given_up = self._given_up_error(rank, op, seq)
                if given_up is not None:
                    raise given_up
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                absent = missing()
                absent = None if absent is None else sorted(absent)
                if rank is not None:  # the peers still waiting, and any that come later, stop now
                    self.gave_up.setdefault(rank, (op, seq, absent, timeout))
                    self.wake_all()
                raise in_world(CollectiveTimeoutError(op, seq, absent, timeout), self.world_ranks)
            if self.world.finished or self.departures:
                gone = self._departed_error(op, seq, missing(), now - start, channel)
                if gone is not None:  # a rank that left is missing: it can never arrive
                    raise in_world(gone, self.world_ranks)
            if now - start >= STALL_GRACE:
                stalled = self.stall_error(op, seq, missing(), now - start)
                if stalled is not None:  # the missing ranks can never arrive: stop now
                    raise stalled
            # Wake at least once a second: a peer failure notifies us, this is only a backstop.
            cond.wait(min(remaining, 1.0))
        # No failure check once ready: a call that completed is not undone by a peer failing
        # afterwards; this rank learns of the failure at its next wait.

    def _given_up_error(self, rank: int, op: str, seq: int) -> CollectiveTimeoutError | None:
        """What ``rank`` raises at collective ``seq`` once a rank of the group (itself included)
        has given up on a call at or before it; None if none has."""
        given = [(s, r != rank, r, g_op, missing, t)
                 for r, (g_op, s, missing, t) in self.gave_up.items() if s <= seq]
        if not given:
            return None
        g_seq, _, who, g_op, missing, timeout = min(given)
        return gave_up_error(g_op, g_seq, missing, timeout, None if who == rank else who, op, seq,
                             self.world_ranks)

    def stall_error(self, op: str, seq: int, absent, waited: float) -> CollectiveTimeoutError | None:
        """The error for a wait whose ``absent`` (local) ranks can never arrive, or None when
        they may (``[Note: ranks sharing a GPU, waiting inside backward]``)."""
        device = autograd_device()
        if device is None or not absent:
            return None
        stuck = self.world.ranks_on_gpu(device, [self.global_ranks[r] for r in absent])
        if not stuck:
            return None
        return CollectiveTimeoutError(op, seq, sorted(absent), round(waited, 1), world_note(
            absent, self.world_ranks) + shared_gpu_note(op, device, stuck), early=True)

    def _departed_error(self, op: str, seq: int, absent, waited: float,
                        channel: tuple[int, int, int] | None) -> Exception | None:
        """The error for a wait whose ``absent`` ranks include one that can never make this call:
        its function under ``spawn`` returned (``_finished_error``), or it shut its backend here
        down having issued fewer calls (for a receive on ``channel``, sent fewer messages on it),
        worded as on Gloo and MPI (``distframe.backends.departures``); None if every one may come."""
        gone = self._finished_error(op, seq, absent, waited)
        if gone is not None or not self.departures:
            return gone
        left = {r: d for r, d in list(self.departures.items())
                if self.global_ranks[r] not in self.world.leaving}  # named by _finished_error
        if channel is None:
            return departure_error(left, op, seq, waited)
        src, dst, tag = channel
        return receive_departure_error(left.get(src), src, dst, tag, seq, waited)

    def _finished_error(self, op: str, seq: int, absent, waited: float) -> CollectiveTimeoutError | None:
        """The error for a wait whose ``absent`` (local) ranks include some whose function under
        ``spawn`` has returned, naming those (the others may still come); None if there are none."""
        gone = sorted(r for r in absent if self.global_ranks[r] in self.world.finished)
        if not gone:
            return None
        who = f"rank {gone[0]}" if len(gone) == 1 else f"ranks {gone}"
        detail = (f"{who} returned from the function spawn ran without making this call, so "
                  "this rank stopped at once instead of waiting for the timeout")
        return CollectiveTimeoutError(op, seq, gone, round(waited, 1),
                                      world_note(gone, self.world_ranks) + detail, early=True)

    def missing_ranks(self, seq: int) -> set[int]:
        """The ranks that have not (yet) posted to collective ``seq``, or not left it."""
        with self.cond:
            slot = self._slots.get(seq)
            if slot is None:  # done and freed, or no rank has reached it yet
                return set() if seq <= self._freed_through else set(range(self.size))
            if len(slot.signatures) < self.size:
                return set(range(self.size)) - set(slot.signatures)
            return set(range(self.size)) - slot.departed
