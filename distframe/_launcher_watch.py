"""Rank processes started by a launcher in this package (the Gloo/NCCL ``ProcessPool``, the MPI
pool's ``mpiexec`` job) end when the launcher's process dies.

A launcher that is killed, or ended by a signal it does not handle, runs none of its cleanup, and
its ranks went on: training for as long as the job lasted and writing checkpoints into the run's
directory, racing a later ``--resume`` of the same run. Each rank process watches its launcher
from a daemon thread and, once it has gone, exits at once (``os._exit``: its peers are exiting
too, so nothing could complete). What the rank was doing is lost; checkpoints are written to a
temporary directory and renamed into place, so the last complete one stays loadable. An MPI rank
first unlinks the MPICH shared-memory segments it maps, which ``os._exit`` would leave in /dev/shm
for good ([Note: MPICH's segments after a kill] in distframe/_mpi_segments.py): the job's other
ranks on this node are ending too, and their mappings outlive the name.
"""
from __future__ import annotations

import os
import sys
import threading
import time

from distframe._mpi_segments import unlink_own_segments

POLL_S = 0.5
PID_ENV = "DISTFRAME_LAUNCHER_PID"


def _state(pid: int) -> tuple[str, str] | None:
    """``(state letter, start time)`` of process ``pid`` from /proc; None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return fields[0], fields[19]


def _alive(pid: int, started: str | None) -> bool:
    if os.path.isdir("/proc"):
        state = _state(pid)
        # A zombie has died (its parent has not reaped it yet); another start time: pid reused.
        return state is not None and state[0] != "Z" and (started is None or state[1] == started)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch_launcher(pid: int | None) -> None:
    """Ends this process once process ``pid`` (the launcher) has gone; nothing if None."""
    if pid is None:
        return
    state = _state(pid) if os.path.isdir("/proc") else None
    started = None if state is None else state[1]

    def watch() -> None:
        while _alive(pid, started):
            time.sleep(POLL_S)
        sys.stderr.write(f"distframe: rank process {os.getpid()} ends: its launcher (pid {pid}) has gone\n")
        sys.stderr.flush()
        unlink_own_segments()
        os._exit(1)

    threading.Thread(target=watch, name="distframe-launcher-watch", daemon=True).start()
