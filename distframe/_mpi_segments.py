"""MPICH's shared-memory segments (``/dev/shm/mpich_shm_*``) of an ``MPIPool`` job, and their
removal after the job had to be killed.

[Note: MPICH's segments after a kill] MPICH creates a segment per node in ``MPI_Init`` (1-3 MB for
a few ranks) and unlinks it in ``MPI_Finalize`` only, so a killed job leaves it in /dev/shm for
good. ``MPIPool`` ends its job normally whenever the ranks are idle, and kills it only on Ctrl-C,
a rank that died or a run past ``run_timeout``; then it removes what that job left. Which files:
each rank reports, when it connects, the segments it maps (its own ``/proc/self/maps``, read after
``MPI_Init``), so only files that this job's ranks had mapped are candidates, never those of
another job started at about the same time (a listing of /dev/shm before and after the job
could not tell them apart). A file is removed only once none of the job's ranks maps it (each
rank's ``/proc/PID/maps``, polled for a few seconds while the killed ranks finish exiting); one
still mapped after that, or whose mappings cannot be read, is left alone.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable

PREFIX = "/dev/shm/mpich_shm_"
SETTLE_SECONDS = 5.0


def mapped_segments(pid: int | str = "self") -> set[str]:
    """The MPICH segments that process ``pid`` maps (none once it has exited). Raises
    PermissionError where its mappings cannot be read."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            lines = [line for line in maps if PREFIX in line]
    except (FileNotFoundError, ProcessLookupError):
        return set()
    paths = {line.split(maxsplit=5)[5].rstrip("\n") for line in lines}
    return {p for p in paths if p.startswith(PREFIX) and not p.endswith(" (deleted)")}


def remove_segments(segments: Iterable[str], pids: Iterable[int]) -> None:
    """Unlinks those of ``segments`` that still exist once no process of ``pids`` (the killed
    job's ranks) maps them, waiting up to ``SETTLE_SECONDS`` for that."""
    left = {path for path in segments if os.path.exists(path)}
    pids = list(pids)
    deadline = time.monotonic() + SETTLE_SECONDS
    while left:
        try:
            in_use = set().union(*(mapped_segments(pid) for pid in pids)) & left
        except PermissionError:
            return  # cannot tell whether a rank still uses them: leave them
        for path in left - in_use:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        left = in_use
        if left:
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)


def unlink_own_segments() -> None:
    """Unlinks the MPICH segments this process maps, for a rank about to end without
    ``MPI_Finalize`` while its job ends too: the other ranks attached in ``MPI_Init``, and their
    mappings outlive the name."""
    try:
        segments = mapped_segments()
    except OSError:
        return
    for path in segments:
        try:
            os.unlink(path)
        except OSError:  # another rank of the job got there first
            pass
