"""Leaving an ``MPIPool`` block by an exception (Ctrl-C in the middle of a run) kills its job at
once. It used to send each rank the shutdown message, which busy ranks do not read, and wait
10 s for them: ``distframe train --backend mpi`` went on training (and checkpointing) for those
10 s after Ctrl-C before the ranks were killed."""
from __future__ import annotations

import pytest

pytest.importorskip("mpi4py", reason="the MPI engine needs the [mpi] extra (mpi4py, mpich)")

from distframe import _mpi_launch  # noqa: E402

pytestmark = pytest.mark.mpi


def test_an_exception_kills_the_job_and_a_normal_exit_shuts_it_down(monkeypatch):
    calls = []
    for name in ("kill", "close"):
        original = getattr(_mpi_launch._Job, name)
        monkeypatch.setattr(_mpi_launch._Job, name,
                            lambda job, _name=name, _original=original: (calls.append(_name), _original(job))[1])
    with pytest.raises(KeyboardInterrupt):
        with _mpi_launch.MPIPool(2, timeout=30):
            raise KeyboardInterrupt
    assert calls == ["kill"]
    calls.clear()
    with _mpi_launch.MPIPool(2, timeout=30):
        pass
    assert calls == ["close"]
