"""Bounded waits for the MPI engine: poll a request until a deadline, say who is missing, and stop
at once when a peer has departed (``distframe.backends.departures``).

[Note: why polling] MPI's blocking calls cannot be interrupted, so the engine starts every
operation non-blocking and polls ``Request.Test()`` until it completes or ``call.timeout``
passes. In MPICH a non-blocking collective advances only while some MPI call runs, so the poll
spins (which is what a blocking call does anyway) for ``SPIN_SECONDS`` and only then sleeps,
with a delay growing to 1 ms, so that a rank waiting for a late peer does not hog a core. The
spin yields the CPU between polls (``sched_yield``): with more ranks than cores (3 ranks on 2
cores) a pure spin made a 1 MB all-reduce about 2x slower than MPICH's blocking call, the
yielding one within noise of it; with a core per rank the yield costs nothing measurable.
Only once the spin is over does the poll ask, every ``CHECK_SECONDS``, whether a peer that can
never arrive has departed, so a call that completes within the spin pays nothing for it.

[Note: progress board] To name the ranks that did not arrive without another collective, each
rank writes the sequence number of the collective it has entered into a small file mapped into
memory (one per rank, in /dev/shm where it exists), and maps its same-node peers' files
read-only. Publishing is one 8-byte store per call; reading needs no MPI call at all, so it works
even when the missing peer is busy in Python and never enters MPI (passive-target RMA does not:
with MPICH over UCX a Get waits for the target to make progress). The files are unlinked as soon
as every peer has mapped them, so a killed job leaves nothing behind. Ranks on other nodes are
reported as unknown. A second word says whether the rank has departed: 0 while it has not, else
the number of calls it had issued plus one, negated if it failed (one 8-byte store, so a peer
never reads half of it). Departures of ranks on other nodes are not seen. Before that word, a
departing rank writes the messages it had sent and the receives it had posted: word 2 holds how
many channels follow (-1 when they do not fit in the page: unknown), then (direction, peer, tag,
count) for each, direction 0 for messages sent to peer, 1 for receives posted from it. The map's
second part holds the rank's call slots (``distframe.backends.call_slots``), the third the
point-to-point messages it has sent (``distframe.backends.mpi_messages``). x86 keeps stores
in order and so does a reader's loads, so a peer that sees the departure word sees the table.
"""
from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from distframe.backends import mpi_messages
from distframe.backends.call_slots import AREA_BYTES, CallSlots, close_map, create_shared, open_shared
from distframe.backends.departures import Departure

SPIN_SECONDS = 0.05
MAX_SLEEP_SECONDS = 1e-3
CHECK_SECONDS = 0.05
_SENT_AT = mmap.PAGESIZE + AREA_BYTES
_MAP_BYTES = _SENT_AT + mpi_messages.AREA_BYTES  # the board's page, the call slots, the messages sent
_yield_cpu = getattr(os, "sched_yield", lambda: None)


def wait_request(request: Any, deadline: float,
                 on_stuck: Callable[[float, bool], BaseException | None], status: Any = None) -> None:
    """Polls ``request`` until it completes. Past ``deadline`` (``time.monotonic``) raises
    ``on_stuck(seconds waited, True)``; after the spin, raises at once what ``on_stuck(seconds
    waited, False)`` returns, asked every ``CHECK_SECONDS`` (an error when the call can never
    complete). The request is left pending when this raises: the caller keeps it alive."""
    if request.Test(status):
        return
    start = time.monotonic()
    spin_until = check_at = min(start + SPIN_SECONDS, deadline)
    delay = 1e-5
    while not request.Test(status):
        now = time.monotonic()
        if now >= deadline:
            raise on_stuck(now - start, True)
        if now < spin_until:
            _yield_cpu()
            continue
        if now >= check_at:
            error = on_stuck(now - start, False)
            if error is not None:
                raise error
            check_at = now + CHECK_SECONDS
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, MAX_SLEEP_SECONDS)


class ProgressBoard:
    """The sequence number each rank of a communicator has reached, readable without MPI by its
    same-node peers. Building one is collective over ``comm`` (blocking, construction time only)."""

    def __init__(self, comm: Any, MPI: Any) -> None:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            self._own_map, path = create_shared(_MAP_BYTES, "distframe-progress-")
            try:
                entries = node.allgather((comm.Get_rank(), path))
                self._peer_maps = {rank: open_shared(p, _MAP_BYTES) for rank, p in entries if p != path}
                node.Barrier()  # every peer has mapped every file: the names can go
            finally:
                os.unlink(path)
        finally:
            node.Free()
        # Word 0: the last sequence number entered; word 1: the departure; then the messages sent
        # (see the module's notes).
        self._own = np.frombuffer(self._own_map, dtype=np.int64, count=mmap.PAGESIZE // 8)
        self._own_rank = comm.Get_rank()
        # The second part of each map holds the call slots (distframe.backends.call_slots).
        self.slots = CallSlots(self._own_map, self._peer_maps, self._own_rank, offset=mmap.PAGESIZE)
        # The third part: the point-to-point messages sent (distframe.backends.mpi_messages).
        self.sent = mpi_messages.SentMessages(self._own_map, self._peer_maps, self._own_rank, _SENT_AT)
        self._peers = {rank: np.frombuffer(m, dtype=np.int64, count=mmap.PAGESIZE // 8)
                       for rank, m in self._peer_maps.items()}

    def publish(self, seq: int) -> None:
        self._own[0] = seq

    def depart(self, issued: int, failed: bool, p2p_counts: dict[tuple[str, int, int], int]) -> None:
        """Announces that this rank has left after issuing ``issued`` calls, sending
        ``p2p_counts[("send", receiver, tag)]`` messages on each channel and posting
        ``p2p_counts[("recv", sender, tag)]`` receives; the first announcement stands (a closed
        board announces nothing)."""
        if self._own is None or self._own[1] != 0:
            return
        channels = [(int(direction == "recv"), peer, tag, n) for (direction, peer, tag), n
                    in list(p2p_counts.items())]
        if 3 + 4 * len(channels) <= len(self._own):
            self._own[3:3 + 4 * len(channels)] = np.array(channels, dtype=np.int64).reshape(-1)
            self._own[2] = len(channels)
        else:
            self._own[2] = -1
        self._own[1] = -(issued + 1) if failed else issued + 1

    def last_entered(self) -> int:
        """The sequence number of the last call this rank entered (published)."""
        return int(self._own[0]) if self._own is not None else 0

    def depart_after_entered(self, p2p_counts: dict[tuple[str, int, int], int]) -> None:
        """``depart`` after the last call this rank entered: for a backend that is gone, which has
        no call left to run."""
        if self._own is not None:
            self.depart(int(self._own[0]), False, p2p_counts)

    def departures(self) -> dict[int, Departure]:
        """The same-node peers that have departed."""
        departed = {}
        for rank, view in self._peers.items():
            word = int(view[1])
            if word:
                count = int(view[2])
                table = view[3:3 + 4 * max(count, 0)].reshape(-1, 4).tolist()
                sent, received = ({(peer, tag): n for way, peer, tag, n in table if way == direction}
                                  for direction in (0, 1))
                departed[rank] = (Departure(abs(word) - 1, word < 0, sent, received) if count >= 0
                                  else Departure(abs(word) - 1, word < 0))
        return departed

    def read(self) -> dict[int, int]:
        """Rank -> last published sequence number, for this rank and its same-node peers."""
        seen = {rank: int(view[0]) for rank, view in self._peers.items()}
        seen[self._own_rank] = int(self._own[0])
        return seen

    def close(self) -> None:
        self.slots.close()
        self.sent.close()
        self._own = None
        self._peers = {}
        for m in [self._own_map, *self._peer_maps.values()]:
            close_map(m)
        self._peer_maps = {}


def missing_ranks(seen: dict[int, int], seq: int, world_size: int) -> tuple[list[int], list[int]]:
    """(ranks known not to have reached ``seq``, ranks whose progress cannot be read)."""
    missing = sorted(r for r, s in seen.items() if s < seq)
    unknown = sorted(set(range(world_size)) - set(seen))
    return missing, unknown
