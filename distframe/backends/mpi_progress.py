"""Bounded waits for the MPI engine: poll a request until a deadline, and say who is missing.

[Note: why polling] MPI's blocking calls cannot be interrupted, so the engine starts every
operation non-blocking and polls ``Request.Test()`` until it completes or ``call.timeout``
passes. In MPICH a non-blocking collective advances only while some MPI call runs, so the poll
spins (which is what a blocking call does anyway) for ``SPIN_SECONDS`` and only then sleeps,
with a delay growing to 1 ms, so that a rank waiting for a late peer does not hog a core. The
spin yields the CPU between polls (``sched_yield``): with more ranks than cores (3 ranks on 2
cores) a pure spin made a 1 MB all-reduce about 2x slower than MPICH's blocking call, the
yielding one within noise of it; with a core per rank the yield costs nothing measurable.

[Note: progress board] To name the ranks that did not arrive without another collective, each
rank writes the sequence number of the collective it has entered into a small file mapped into
memory (one per rank, in /dev/shm where it exists), and maps its same-node peers' files
read-only. Publishing is one 8-byte store per call; reading needs no MPI call at all, so it works
even when the missing peer is busy in Python and never enters MPI (passive-target RMA does not:
with MPICH over UCX a Get waits for the target to make progress). The files are unlinked as soon
as every peer has mapped them, so a killed job leaves nothing behind. Ranks on other nodes are
reported as unknown.
"""
from __future__ import annotations

import mmap
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

SPIN_SECONDS = 0.05
MAX_SLEEP_SECONDS = 1e-3
_yield_cpu = getattr(os, "sched_yield", lambda: None)


def wait_request(request: Any, deadline: float, on_timeout: Callable[[], BaseException],
                 status: Any = None) -> None:
    """Polls ``request`` until it completes; past ``deadline`` (``time.monotonic``) raises
    ``on_timeout()``. The request is left pending on timeout: the caller keeps it alive."""
    if request.Test(status):
        return
    start = time.monotonic()
    spin_until = min(start + SPIN_SECONDS, deadline)
    delay = 1e-5
    while not request.Test(status):
        now = time.monotonic()
        if now >= deadline:
            raise on_timeout()
        if now < spin_until:
            _yield_cpu()
        else:
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, MAX_SLEEP_SECONDS)


class ProgressBoard:
    """The sequence number each rank of a communicator has reached, readable without MPI by its
    same-node peers. Building one is collective over ``comm`` (blocking, construction time only)."""

    def __init__(self, comm: Any, MPI: Any) -> None:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            self._own_map, path = _create_map()
            try:
                entries = node.allgather((comm.Get_rank(), path))
                self._peer_maps = {rank: _open_map(p) for rank, p in entries if p != path}
                node.Barrier()  # every peer has mapped every file: the names can go
            finally:
                os.unlink(path)
        finally:
            node.Free()
        self._own = np.frombuffer(self._own_map, dtype=np.int64, count=1)
        self._own_rank = comm.Get_rank()
        self._peers = {rank: np.frombuffer(m, dtype=np.int64, count=1)
                       for rank, m in self._peer_maps.items()}

    def publish(self, seq: int) -> None:
        self._own[0] = seq

    def read(self) -> dict[int, int]:
        """Rank -> last published sequence number, for this rank and its same-node peers."""
        seen = {rank: int(view[0]) for rank, view in self._peers.items()}
        seen[self._own_rank] = int(self._own[0])
        return seen

    def close(self) -> None:
        self._own = None
        self._peers = {}
        for m in [self._own_map, *self._peer_maps.values()]:
            try:
                m.close()
            except BufferError:  # a view is still referenced somewhere; the GC unmaps it later
                pass
        self._peer_maps = {}


def _create_map() -> tuple[mmap.mmap, str]:
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="distframe-progress-", dir=directory)
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        return mmap.mmap(fd, mmap.PAGESIZE), path
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _open_map(path: str) -> mmap.mmap:
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), mmap.PAGESIZE, access=mmap.ACCESS_READ)


def missing_ranks(seen: dict[int, int], seq: int, world_size: int) -> tuple[list[int], list[int]]:
    """(ranks known not to have reached ``seq``, ranks whose progress cannot be read)."""
    missing = sorted(r for r, s in seen.items() if s < seq)
    unknown = sorted(set(range(world_size)) - set(seen))
    return missing, unknown
