"""Rank processes end when their launcher dies (killed, or ended by a signal it does not handle):
they used to go on training, and writing checkpoints into the run's directory, for as long as the
job lasted, racing a later --resume of the same run. MPI ranks leave no MPICH segment in /dev/shm."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = """
import sys, time
from tests.test_launcher_death import sleep_after_writing_pid
from distframe._process_launch import ProcessPool
from distframe._mpi_launch import MPIPool
pool = ProcessPool(2, "gloo", timeout=120) if sys.argv[1] == "gloo" else MPIPool(2, timeout=120)
pool.run(sleep_after_writing_pid, sys.argv[2])
"""


def sleep_after_writing_pid(backend, directory: str) -> None:
    from distframe._mpi_segments import mapped_segments
    segments = {path: os.stat(path).st_ino for path in mapped_segments()}  # MPICH's, under MPI
    Path(directory, f"rank{backend.rank}.segments").write_text(json.dumps(segments))
    Path(directory, f"rank{backend.rank}.pid").write_text(str(os.getpid()))
    time.sleep(120)


def _left_in_shm(directory: Path) -> list[str]:
    """The segments the ranks mapped whose file (the same inode) is still there."""
    left = []
    for record in directory.glob("rank*.segments"):
        for path, inode in json.loads(record.read_text()).items():
            if os.path.exists(path) and os.stat(path).st_ino == inode:
                left.append(path)
    return left


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
@pytest.mark.parametrize("engine", [pytest.param("gloo", marks=pytest.mark.gloo),
                                    pytest.param("mpi", marks=pytest.mark.mpi)])
def test_rank_processes_end_when_their_launcher_is_killed(engine, tmp_path):
    if engine == "mpi":
        pytest.importorskip("mpi4py", reason="the MPI engine needs the [mpi] extra (mpi4py, mpich)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, engine, str(tmp_path)], cwd=REPO_ROOT,
                                env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert launcher.poll() is None, launcher.stderr.read()
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        assert all(_alive(pid) for pid in pids)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in pids), "rank processes outlived their launcher"
        if engine == "mpi":  # MPICH's segment, which only MPI_Finalize unlinks, went with them
            assert list(tmp_path.glob("rank*.segments")) and _left_in_shm(tmp_path) == []
    finally:
        launcher.kill()
        launcher.wait()
        for p in tmp_path.glob("rank*.pid"):
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
