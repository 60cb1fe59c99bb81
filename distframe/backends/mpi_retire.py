"""Freeing an engine's MPI communicator only once nothing sent on it can outlive it.

[Note: freeing a communicator] MPICH gives a freed communicator's context id to the next one
that ``Dup`` or ``Split`` makes, and a message still queued for the freed one then matches the
new one: a send that no one received, or the data of a broadcast whose root sent eagerly while
a peer never joined it, reached a fresh backend's receive or broadcast as if sent there (a second
``init_backend``, a new subgroup, the next ``MPIPool`` run), with no error anywhere.

So ``shutdown`` does not free the communicator at once. It sends every peer, on a tag that user
messages cannot use, three numbers: the collectives it issued on the communicator, and the
messages it sent to and received from that peer; and it posts a receive for the peer's. Freeing
waits until every peer's numbers have arrived (polled, never waited for, whenever this process
is about to build a communicator) and then happens only if they match this rank's: the same
number of collectives, and every message each of the two sent received by the other. Otherwise
the communicator is kept until ``MPI_Finalize``, so its context id is never handed out again.
MPICH picks a context id that is free on every rank of the parent, so a rank that keeps one keeps
it from every new communicator, whatever its peers decided.

Each rank decides from what concerns itself: messages that could still reach it are those its
peers sent it and it did not receive, and collective traffic from peers that issued more
collectives than it did. A peer that never shuts the communicator down keeps it held here.
The cost at shutdown: two small non-blocking messages per peer.
"""
from __future__ import annotations

import atexit
import ctypes
import time
from typing import Any

import numpy as np

#: User tags are below 2**20 and debug-mode headers below 2**22 (``mpi_p2p``).
RETIRE_TAG = 2 ** 28

# Per process, as MPI itself is: communicators waiting for their peers' numbers, and those kept
# to the end with their pending requests and buffers (referenced so that nothing frees them).
_retiring: list[_Retiring] = []
_kept: list[Any] = []
_dropped: list[tuple[Any, ...]] = []  # retire_later's, for the next free_retired
_exit_hook = False


class _Retiring:
    """A communicator this rank has shut down, waiting for its peers' numbers."""

    def __init__(self, comm: Any, MPI: Any, collectives: int,
                 p2p_counts: dict[tuple[str, int, int], int]) -> None:
        self.comm, self.MPI = comm, MPI
        rank, world = comm.Get_rank(), comm.Get_size()
        self.sent, self.received = [0] * world, [0] * world
        for (direction, peer, _tag), count in p2p_counts.items():
            (self.sent if direction == "send" else self.received)[peer] += count
        self.collectives = collectives
        peers = [p for p in range(world) if p != rank]
        self.mine = {p: np.array([collectives, self.sent[p], self.received[p]], dtype=np.int64)
                     for p in peers}
        self.theirs = {p: np.full(3, -1, dtype=np.int64) for p in peers}
        self.receives = [comm.Irecv(self.theirs[p], p, RETIRE_TAG) for p in peers]
        self.sends = [comm.Isend(self.mine[p], p, RETIRE_TAG) for p in peers]

    def outcome(self) -> str | None:
        """"free", "keep", or None while a peer's numbers have not arrived."""
        if not self.MPI.Request.Testall(self.receives + self.sends):
            return None
        for peer, (collectives, sent_to_me, received_from_me) in self.theirs.items():
            if (collectives != self.collectives or sent_to_me != self.received[peer]
                    or received_from_me != self.sent[peer]):
                return "keep"
        return "free"

    def cancel(self) -> None:
        """At exit: receives that no peer will complete are cancelled, not left to Finalize."""
        for request in self.receives:
            if not request.Test():
                request.Cancel()
                request.Wait()


def retire(comm: Any, MPI: Any, collectives: int, p2p_counts: dict[tuple[str, int, int], int],
           abandoned: list[Any]) -> None:
    """Frees ``comm`` once its peers' numbers show that nothing sent on it can outlive it (see the
    module's notes). ``abandoned``: this rank's requests on it that were given up on, with the
    buffers MPI may still write; if any has not completed, they and ``comm`` are kept for good
    (freed with the backend, a receive's buffer took a late message into memory in other use)."""
    _start_retiring(comm, MPI, collectives, p2p_counts, abandoned)
    free_retired()


def retire_later(comm: Any, MPI: Any, collectives: int, p2p_counts: dict[tuple[str, int, int], int],
                 abandoned: list[Any]) -> None:
    """``retire`` at the next ``free_retired``, for the communicator of a backend that was garbage
    collected without ``shutdown()`` (a group made per step and dropped): its finalizer may run in
    any thread, at any allocation, so it makes no MPI call itself. Before this, such
    communicators were never freed, and after about 2000 groups MPICH refused the next one ("Too
    many communicators")."""
    _dropped.append((comm, MPI, collectives, p2p_counts, abandoned))


def _start_retiring(comm: Any, MPI: Any, collectives: int,
                    p2p_counts: dict[tuple[str, int, int], int], abandoned: list[Any]) -> None:
    global _exit_hook
    pending = [entry for entry in abandoned if not _settled(entry[0], MPI)]
    if pending or comm.Get_attr(MPI.TAG_UB) < RETIRE_TAG:
        _kept.append((comm, pending))
        return
    if comm.Get_size() == 1:
        comm.Free()
        return
    _retiring.append(_Retiring(comm, MPI, collectives, p2p_counts))
    if not _exit_hook:
        _exit_hook = True
        atexit.register(_cancel_at_exit)


def _settled(request: Any, MPI: Any) -> bool:
    """A request given up on has completed since (a later wait, or a late peer): MPI holds no
    buffer of it any more. A receive whose ``Work.wait(timeout=...)`` expired may be one."""
    try:
        return request.Test()
    except MPI.Exception:  # it completed, with an error (a truncated receive)
        return True


def free_retired() -> None:
    """Starts retiring the dropped backends' communicators, then frees or keeps each retiring
    communicator whose peers' numbers have all arrived."""
    while _dropped:
        _start_retiring(*_dropped.pop(0))
    for retiring in list(_retiring):
        outcome = retiring.outcome()
        if outcome is None:
            continue
        _retiring.remove(retiring)
        if outcome == "free":
            retiring.comm.Free()
        else:
            _kept.append((retiring.comm, []))


def settle_at_exit(timeout: float = 1.0) -> None:
    """At exit, once the script's backends are shut down (launch's exit hook, which may run after
    ``_cancel_at_exit``): waits up to ``timeout`` for the numbers of the communicators still
    retiring (the peers shut down at exit too), then cancels the receives left. MPI finalizes after
    Python has freed the receives' buffers, and numbers that arrived then were written into freed
    memory: "malloc(): unsorted double linked list corrupted" at exit, about 1 run in 6 at 4
    ranks. The buffers of abandoned requests kept for good are never freed from here on."""
    deadline = time.monotonic() + timeout
    try:
        while (_retiring or _dropped) and time.monotonic() < deadline:
            free_retired()
            if _retiring:
                time.sleep(0.001)
    finally:
        _cancel_at_exit()
        if _kept:  # one reference that nothing drops: finalization frees none of them
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(_kept))


def _cancel_at_exit() -> None:
    for retiring in _retiring:
        try:
            retiring.cancel()
        except Exception:  # noqa: BLE001 - MPI may be finalized already; nothing to do then
            return
