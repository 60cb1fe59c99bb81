"""An MPI job leaves no MPICH shared-memory segment (``/dev/shm/mpich_shm_*``, 1-3 MB) behind.

MPICH unlinks its segment in ``MPI_Finalize`` only. ``MPIPool`` (and so ``spawn(backend="mpi")``)
used to SIGKILL its job whenever an exception left the pool, a rank's ordinary error included,
so every failed run leaked one. Now a job whose ranks are idle (a rank raised, or ``run`` refused
the function before sending it) is shut down as usual, and a job that must be killed (Ctrl-C, a
rank that died, a run past ``run_timeout``) has its segments removed once its ranks are gone.

Each test learns the segments from the ranks themselves (``/proc/self/maps``), so segments of
other jobs running on the machine at the same time do not matter.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

pytest.importorskip("mpi4py", reason="the MPI engine needs the [mpi] extra (mpi4py, mpich)")

from distframe import _mpi_launch  # noqa: E402
from distframe._mpi_launch import MPIPool  # noqa: E402
from distframe.errors import ConfigError, RankFailedError  # noqa: E402
from distframe.launch import spawn  # noqa: E402
from tests.backends.test_mpi_faults import die_on_rank_one  # noqa: E402

pytestmark = pytest.mark.mpi


def mapped_segments(b=None) -> list[str]:
    """The MPICH segments this process maps, as ``"<path> <inode>"``: a segment another job makes
    later under the same name (as a killed job in another test worker may leave) is another file."""
    with open("/proc/self/maps") as maps:
        fields = [line.split(maxsplit=5) for line in maps if "/dev/shm/mpich_shm_" in line]
    return sorted({f"{f[5].strip()} {f[4]}" for f in fields if not f[5].strip().endswith("(deleted)")})


def record_segments_then_raise(b, record: str):
    Path(record, f"rank{b.rank}.json").write_text(json.dumps(mapped_segments()))
    b.barrier()  # every rank has written its file
    if b.rank == 1:
        raise KeyError("rank 1 gives up")
    return b.rank


def stay_on_rank_one(b):
    if b.rank == 1:
        time.sleep(120)  # past the run's run_timeout: the job is killed
    return b.rank


def _existing(segments) -> list[str]:
    """The segments (from ``mapped_segments``) whose file is still there, with its age."""
    left = []
    for segment in segments:
        path, inode = segment.rsplit(" ", 1)
        try:
            found = os.stat(path)
        except FileNotFoundError:
            continue
        if found.st_ino == int(inode):
            left.append(f"{path} (modified {time.time() - found.st_mtime:.1f} s ago)")
    return left


@pytest.fixture
def ends(monkeypatch):
    """How each job ended: "kill" or "close"."""
    seen = []
    for name in ("kill", "close"):
        original = getattr(_mpi_launch._Job, name)
        def spy(job, _name=name, _original=original):
            seen.append(_name)
            return _original(job)
        monkeypatch.setattr(_mpi_launch._Job, name, spy)
    return seen


def test_a_rank_that_raises_ends_the_job_normally_and_leaves_no_segment(tmp_path, ends):
    with pytest.raises(KeyError, match="rank 1 gives up"):
        spawn(functools.partial(record_segments_then_raise, record=str(tmp_path)), 2, "mpi", timeout=30)
    segments = sorted({p for f in tmp_path.glob("rank*.json") for p in json.loads(f.read_text())})
    assert segments, "the ranks map no MPICH segment: nothing to check"
    assert ends == ["close"]
    assert _existing(segments) == []


def test_a_function_from_main_is_refused_and_the_job_ends_normally(monkeypatch, ends):
    main = sys.modules["__main__"]
    in_main = types.FunctionType(mapped_segments.__code__, globals(), "distframe_test_in_main")
    in_main.__module__, in_main.__qualname__ = "__main__", in_main.__name__
    monkeypatch.setattr(main, in_main.__name__, in_main, raising=False)
    with pytest.raises(ConfigError, match="defined in the __main__ script"):
        with MPIPool(2, timeout=30) as pool:
            segments = sorted(set(sum(pool.run(mapped_segments), [])))
            pool.run(in_main)
    assert segments
    assert ends == ["close"]
    assert _existing(segments) == []


def test_a_killed_job_leaves_no_segment(ends):
    pool = MPIPool(2, timeout=30)
    with pytest.raises(KeyboardInterrupt):
        with pool:
            first = sorted(set(sum(pool.run(mapped_segments), [])))
            with pytest.raises(RankFailedError):
                pool.run(die_on_rank_one)  # mpiexec ends the job: the next run starts another
            assert first and _existing(first) == []
            second = sorted(set(sum(pool.run(mapped_segments), [])))
            pool.run_timeout = 1.0
            with pytest.raises(TimeoutError):
                pool.run(stay_on_rank_one)  # killed: its ranks do not answer
            assert second and _existing(second) == []
            pool.run_timeout = None
            third = sorted(set(sum(pool.run(mapped_segments), [])))
            raise KeyboardInterrupt  # Ctrl-C: killed at once
    assert third and _existing(third) == []
    assert "kill" in ends


UNLINK_OWN = """
import os
from distframe.backends.mpi_buffers import import_mpi
from distframe._mpi_segments import mapped_segments, unlink_own_segments
MPI = import_mpi()  # a singleton: MPI_Init makes this process's segment
found = mapped_segments()
assert found, "MPI_Init mapped no MPICH segment: nothing to check"
unlink_own_segments()
assert not [p for p in found if os.path.exists(p)]
MPI.COMM_WORLD.Barrier()  # the mapping outlives the name
print("ok")
"""


def test_a_rank_ending_without_finalize_unlinks_its_segments_first():
    """What a rank does before ``os._exit`` when its launcher died, or when MPI failed to start
    for it (another MPI's launcher): its job is ending, and ``MPI_Finalize`` will not run."""
    done = subprocess.run([sys.executable, "-c", UNLINK_OWN], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
