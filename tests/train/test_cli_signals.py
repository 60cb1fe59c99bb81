"""SIGTERM to the ``distframe`` command takes Ctrl-C's path: the launcher tears its rank
processes down (a terminated parent used to leave its Gloo ranks running), the command exits 130
naming the last complete checkpoint (and nothing else: no resource-tracker warning), and that
checkpoint loads. Under mpiexec, Ctrl-C leaves no MPICH shared memory behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train.conftest import TINY
from tests.train.test_launch_errors import requires_mpi
from tests.train.test_launchers import _mpiexec


def _session_members(session: int) -> list[int]:
    """Processes of this machine in ``session`` (the 6th field of /proc/<pid>/stat)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat.rsplit(")", 1)[-1].split()  # from the state on: state ppid pgrp session
        if fields[0] not in ("Z", "X") and int(fields[3]) == session:
            members.append(int(entry))
    return members


def test_sigterm_stops_a_gloo_run_and_its_ranks(tmp_path, corpus_file):
    out = tmp_path / "run"
    script = Path(sys.executable).with_name("distframe")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "distframe"]
    proc = subprocess.Popen([*command, "train", *TINY, "--data", corpus_file, "--out", str(out),
                             "--backend", "gloo", "--world-size", "2", "--steps", "100000",
                             "--checkpoint-every", "2", "--eval-every", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its ranks are in its session, found below
    try:
        deadline = time.monotonic() + 180
        while not (out / "checkpoints" / "step-2" / "metadata.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert "leaked" not in err, err[-2000:]  # the resource tracker's, for tqdm's lock in rank 0
    deadline = time.monotonic() + 15
    while _session_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _session_members(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not left, f"processes of the run still running: {left}"
    from distframe.checkpoint import consolidate
    steps = sorted((p for p in (out / "checkpoints").iterdir() if p.name.startswith("step-")),
                   key=lambda p: int(p.name.split("-")[1]))
    assert steps and f"{steps[-1]} is the last complete checkpoint" in err
    for step in steps:
        consolidate(step)


def _mapped_shared_memory(marker: str) -> set[str]:
    """The MPICH shared-memory files that processes whose command line holds ``marker`` map."""
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker not in Path("/proc", entry, "cmdline").read_text():
                continue
            maps = Path("/proc", entry, "maps").read_text()
        except OSError:
            continue
        found |= {line.split()[5] for line in maps.splitlines() if "/dev/shm/mpich_shm" in line}
    return found


@pytest.mark.mpi
@requires_mpi
def test_ctrl_c_under_mpiexec_leaves_no_shared_memory(tmp_path, corpus_file):
    # An interrupted rank leaves with os._exit ([Note: exiting after Ctrl-C] in cli.py), which
    # skipped MPI_Finalize, where MPICH unlinks its segment: about 2 MB in /dev/shm for good.
    out = tmp_path / "run"
    script = Path(sys.executable).with_name("distframe")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "distframe"]
    proc = subprocess.Popen([_mpiexec(), "-n", "2", *command, "train", *TINY, "--data", corpus_file,
                             "--out", str(out), "--backend", "mpi", "--steps", "100000",
                             "--checkpoint-every", "2", "--eval-every", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 180
        while not (out / "checkpoints" / "step-2" / "metadata.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        segments = _mapped_shared_memory(str(out))
        proc.send_signal(signal.SIGINT)  # mpiexec passes it on to the ranks
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert segments, "the ranks mapped no MPICH segment: nothing was checked"
    assert not [path for path in segments if os.path.exists(path)], err[-2000:]
