"""ProgressBoard: each rank says in the store which call it has reached, so that a rank whose
collective timed out can name the ranks that never arrived, and when it leaves a group, so that
ranks waiting for it there stop at once (``distframe.backends.departures``).

[Note: the board costs nothing per call] A collective only records its sequence number in a
dict (one assignment). A background thread copies changed entries to the store at most every
``interval`` seconds, so the hot path makes no store round trip. An entry is therefore up to one
interval stale, which is far below any sensible timeout. The store is read only after a failure,
or while a call has waited for longer than ``WAIT_SLICE``.

[Note: departures in the store] A rank that departs sets ``<progress key>/left`` for each group
it leaves to the number of calls it issued there ("7", or "7 failed"), then appends those keys'
names to one key per world (``departures_key``). A waiting rank reads that key, one round trip
while nobody has left, and the ``left`` keys of its group's peers only when it lists them.
The value also lists the messages the rank had sent on each channel of that group, as
``receiver:tag:count`` words, and the receives it had posted, as ``rsender:tag:count`` words
("7 failed 0:3:1 r0:3:2"). ProcessPool's workers keep their backends from
one run to the next: the pool clears the departures (``clear_departures``) before each run, when
every rank has answered the last one.

[Note: watching a receive] Gloo's receive cannot be waited for in slices: a ``wait(timeout)`` that
times out closes the group's connections. Nor can its reduce_scatter: its ``wait(timeout)`` ignores
the timeout and its ``is_completed()`` stays False. So such a call waits in one piece and registers
a ``WatchedWait`` with the board (two dict operations); the board's thread, which wakes every
``interval`` anyway, asks each that has waited longer than ``WAIT_SLICE`` for its verdict (a
receive: has its sender left without sending the message, ``departures.receive_departure_error``;
a reduce_scatter: has a peer departed, or called something else, ``call_slots``). On an error it
records it and cuts the wait: a receive of the same group waited for with a 1 ms timeout from the
board's thread times out, which closes the group's connections and wakes the waiting call, which
raises the error recorded. The group is unusable after such an error anyway.
"""
from __future__ import annotations

import dataclasses
import datetime
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from distframe.backends.departures import Departure, departure_error

#: How long a call waits before it first asks whether a peer has departed, and between asks.
WAIT_SLICE = datetime.timedelta(seconds=0.2)
_LEFT = "/left"
_CUT = datetime.timedelta(milliseconds=1)
_CUT_TAG = 2**31 - 1  # above every tag a message uses (torch_dist_p2p)
# A rank whose function returns drops the groups it made (their connections close) just before it
# departs: a lost connection is put down to a departure that shows within this many seconds.
DEPARTURE_SETTLE_S = 0.5
_PEER_LOST = ("connection", "closed", "reset by peer", "broken pipe", "aborted", "socket")


def peer_lost(exc: BaseException) -> bool:
    """Whether a transport error says the connection to a peer is gone (not a timeout)."""
    lowered = str(exc).lower()
    return not ("timed out" in lowered or "timeout" in lowered) and any(w in lowered for w in _PEER_LOST)


class ProgressBoard:
    """One per process, shared by a world backend and all its subgroups (each group uses its own
    keys). ``reached(key, seq)`` is the hot-path call; ``behind(keys, seq)`` the diagnosis."""

    def __init__(self, store: dist.Store, interval: float = 0.2,
                 departures_key: str = "distframe/departures") -> None:
        self._store = _own_connection(store)
        self._interval = interval
        self._departures_key = departures_key
        self._latest: dict[str, int] = {}
        self._failed = False  # a departure as failed stands: a later shutdown's does not undo it
        self._written: dict[str, int] = {}
        self._p2p_counts: dict[str, dict[tuple[str, int, int], int]] = {}
        self._watched: dict[int, WatchedWait] = {}
        self._watched_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self, key: str, p2p_counts: dict[tuple[str, int, int], int] | None = None) -> None:
        """Publishes 0 for ``key`` now, so peers can always read it, and starts the writer.
        ``p2p_counts``: the group's live count of messages per ``("send", receiver, tag)`` and
        ``("recv", sender, tag)``, which its departure announces."""
        self._store.set(key, "0")
        self._p2p_counts[key] = {} if p2p_counts is None else p2p_counts
        self._written[key] = self._latest[key] = 0
        if self._thread is None:
            self._thread = threading.Thread(target=self._publish_loop, name="distframe-progress",
                                            daemon=True)
            self._thread.start()

    def reached(self, key: str, seq: int) -> None:
        self._latest[key] = seq

    def behind(self, keys: dict[int, str], seq: int) -> list[int] | None:
        """The ranks (keys of ``keys``) whose published progress is below ``seq``; None when the
        store cannot be read (for example when the process hosting it has gone)."""
        try:
            return [rank for rank, key in sorted(keys.items()) if self._progress(key) < seq]
        except (RuntimeError, ValueError):
            return None

    def _progress(self, key: str) -> int:
        # check() first: get() on a key no one has set would block for the store's timeout.
        return int(self._store.get(key).decode()) if self._store.check([key]) else 0

    def depart(self, under: str, issued: dict[str, int], failed: bool) -> None:
        """Announces that this rank has left the groups whose progress keys start with ``under``
        ([Note: departures in the store]), after issuing ``issued[key]`` calls on each. A group
        missing from ``issued`` is gone (garbage): the last call it entered was its last, and it
        is announced this once, then forgotten."""
        self._failed = self._failed or failed
        suffix = " failed" if self._failed else ""
        counts = {key: issued.get(key, entered) for key, entered in list(self._latest.items())
                  if key.startswith(under)}
        channels = {key: "".join(f" {'' if direction == 'send' else 'r'}{peer}:{tag}:{n}"
                                 for (direction, peer, tag), n in list(self._p2p_counts.get(key, {}).items()))
                    for key in counts}
        for key in counts.keys() - issued.keys():
            self._latest.pop(key, None)
            self._p2p_counts.pop(key, None)
        try:
            for key, count in counts.items():
                self._store.set(key + _LEFT, f"{count}{suffix}{channels[key]}")
            self._store.append(self._departures_key, "".join(f"{key}{_LEFT}\n" for key in counts))
            self._store.check([self._departures_key])  # a round trip: every write has landed
        except RuntimeError:  # the store is gone: nobody is left to wait for this rank
            pass

    def departure_error(self, keys: dict[int, str], op: str, seq: int, waited: float,
                        settle: float = 0.0) -> Exception | None:
        """The error for a wait of ``waited`` seconds in call ``seq`` when a rank of ``keys`` (rank
        -> progress key) has departed (``departures.departure_error``); None when none has, or
        when the store cannot be read. ``settle``: for up to that many seconds, asks again until
        a departure shows."""
        deadline = time.monotonic() + settle
        error = self._departure_error(keys, op, seq, waited)
        while error is None and time.monotonic() < deadline:
            time.sleep(0.05)
            error = self._departure_error(keys, op, seq, waited)
        return error

    def _departure_error(self, keys: dict[int, str], op: str, seq: int,
                         waited: float) -> Exception | None:
        departed = self.departures(keys)
        return None if departed is None else departure_error(departed, op, seq, waited)

    def departures(self, keys: dict[int, str]) -> dict[int, Departure] | None:
        """The ranks of ``keys`` (rank -> progress key) that have departed; None when the store
        cannot be read."""
        try:
            if not self._store.check([self._departures_key]):
                return {}
            listed = set(self._store.get(self._departures_key).decode().split())
            departed = {rank: self._left(key) for rank, key in keys.items() if key + _LEFT in listed}
        except (RuntimeError, ValueError):
            return None
        return {rank: left for rank, left in departed.items() if left is not None}

    def departure(self, key: str) -> Departure | None:
        """How the rank whose progress key is ``key`` left its group; None while it has not (or
        when the store cannot be read)."""
        try:
            return self._left(key)
        except (RuntimeError, ValueError):
            return None

    def _left(self, key: str) -> Departure | None:
        """The departure the rank of progress key ``key`` announced, or None (store errors raise)."""
        if not self._store.check([key + _LEFT]):
            return None
        return _parse_departure(self._store.get(key + _LEFT).decode())

    def watch(self, watched: WatchedWait) -> None:
        """[Note: watching a receive]; ``unwatch`` once its wait has returned or raised."""
        with self._watched_lock:
            self._watched[id(watched)] = watched

    def unwatch(self, watched: WatchedWait) -> None:
        with self._watched_lock:
            self._watched.pop(id(watched), None)

    def _check_watched(self) -> None:
        now = time.monotonic()
        with self._watched_lock:
            slow = [w for w in self._watched.values()
                    if now - w.since > WAIT_SLICE.total_seconds() and w.error is None]
        for watched in slow:
            error = watched.verdict(now - watched.since)
            if error is None:
                continue
            with self._watched_lock:  # not once its wait has ended: the work may be gone
                if id(watched) not in self._watched:
                    continue
                watched.error = error
                try:
                    watched.cut()
                except RuntimeError:  # the cut: it timed out, waking the waiting call
                    pass

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self._interval + 1)

    def _publish_loop(self) -> None:
        while not self._stop.wait(self._interval):
            if self._watched:
                self._check_watched()
            for key, seq in list(self._latest.items()):
                if self._written.get(key) == seq:
                    continue
                try:
                    self._store.set(key, str(seq))
                except RuntimeError:  # the store is gone: nobody is left to read the board
                    return
                self._written[key] = seq


@dataclasses.dataclass
class _Shared:
    """What a world backend and all its subgroups share within one process."""

    store: dist.Store
    board: ProgressBoard
    failed: bool = False
    groups: weakref.WeakSet = dataclasses.field(default_factory=weakref.WeakSet)  # its live backends

    def __post_init__(self) -> None:  # the board's thread ends with the last group that shares it
        weakref.finalize(self, self.board.close)


@dataclasses.dataclass(eq=False)
class WatchedWait:
    """A wait that cannot be sliced ([Note: watching a receive]): ``verdict(seconds waited)`` is
    the error that ends it (None: wait on), ``cut()`` wakes the waiting call; ``error`` once the
    board ended it."""

    verdict: Callable[[float], Exception | None]
    cut: Callable[[], Any]
    since: float = dataclasses.field(default_factory=time.monotonic)
    error: Exception | None = None


def cut_waits(pg: Any, peers: list[int]) -> None:
    """Ends the waits on ``pg`` (Gloo) by closing its connections: receives that no one sends,
    waited for 1 ms, whose timeout closes them. One from each of ``peers``: a connection that a
    peer has closed already (by its own cut) fails at once, without closing the others."""
    for peer in peers:
        try:
            pg.recv([torch.empty(1)], peer, _CUT_TAG).wait(_CUT)
        except RuntimeError:  # timed out (the cut), or that connection was closed already
            pass


def _parse_departure(text: str) -> Departure:
    """A ``left`` value: the calls issued, "failed" if so, then ``receiver:tag:count`` words (sent)
    and ``rsender:tag:count`` words (receives posted)."""
    issued, *words = text.split()
    sent: dict[tuple[int, int], int] = {}
    received: dict[tuple[int, int], int] = {}
    for word in words:
        if word != "failed":
            channels = received if word.startswith("r") else sent
            peer, tag, count = map(int, word.lstrip("r").split(":"))
            channels[(peer, tag)] = count
    return Departure(int(issued), "failed" in words, sent, received)


def _own_connection(store: dist.Store) -> dist.Store:
    """A second client connection where the store offers one, so that the writer thread never
    queues behind a blocking ``wait`` that Gloo's rendezvous makes on the main connection."""
    try:
        return store.clone()
    except (RuntimeError, AttributeError, NotImplementedError):
        return store


def wait_in_slices(work: Any, wait_slice: datetime.timedelta,
                   departure_error: Callable[[float], Exception | None]) -> RuntimeError | None:
    """Waits for ``work`` (a process group's Work) after a first ``work.wait(wait_slice)`` raised,
    one slice at a time, raising at once what ``departure_error(seconds waited)`` returns between
    slices. Returns the work's own failure, or None once it has completed."""
    start = time.monotonic() - wait_slice.total_seconds()
    while not work.is_completed():  # a failed call completes too, with its error
        error = departure_error(time.monotonic() - start)
        if error is not None:
            raise error
        try:
            work.wait(wait_slice)
            return None
        except RuntimeError:  # the slice ended (or the call failed: asked again above)
            pass
    try:
        work.wait()
    except RuntimeError as failure:
        return failure
    return None


def meet_in_store(store: dist.Store, rank: int, ranks: list[int], timeout: float,
                  departure_error: Callable[[float], Exception | None]) -> list[int]:
    """Sets ``rank``'s key in ``store`` and polls until those of every rank of ``ranks`` are set,
    raising at once what ``departure_error(seconds waited)`` returns, asked every ``WAIT_SLICE``.
    Returns the ranks still missing after ``timeout`` seconds ([] once all are there). Polls with
    ``check``: each ``wait`` that times out, as one waiting in slices would, logs two warnings."""
    store.set(str(rank), "1")
    keys = [str(r) for r in ranks]
    start = time.monotonic()
    ask_at = start + WAIT_SLICE.total_seconds()
    delay = 1e-3
    while not store.check(keys):
        now = time.monotonic()
        if now - start >= timeout:
            return [r for r in ranks if not store.check([str(r)])]
        if now >= ask_at:
            error = departure_error(now - start)
            if error is not None:
                raise error
            ask_at = now + WAIT_SLICE.total_seconds()
        time.sleep(delay)
        delay = min(2 * delay, 0.05)
    return []


def wait_for_members(store: dist.Store, rank: int, world_size: int,
                      timeout: datetime.timedelta) -> None:
    """Returns once every member has built its process group.

    [Note: a group is ready only when every member is] Gloo's rendezvous can return on one rank
    while a peer is still finishing its side of their connection. A rank that then closes the
    group at once (a group built and shut down unused) closes that connection under the peer,
    whose construction fails with "Connection closed by peer". So construction ends with a
    store barrier: each member sets its key and waits for everyone's.
    """
    store.set(str(rank), "1")
    store.wait([str(r) for r in range(world_size)], timeout)


def clear_departures(store: dist.Store, prefix: str) -> None:
    """Forgets the departures announced in the world whose backends were built with ``prefix``
    (for a launcher whose backends serve several runs; call it while no rank is in a call)."""
    key = departures_key(prefix)
    if store.check([key]):
        for left in store.get(key).decode().split():
            store.delete_key(left)
        store.delete_key(key)


def departures_key(prefix: str) -> str:
    """The key that lists the departures of the world whose backends were built with ``prefix``."""
    return f"{prefix}/departures"
