"""An mpiexec of one MPI starting ranks whose mpi4py loaded another is an error, not N worlds of 1.

Each rank then initialises MPI as a singleton: before this check every rank was rank 0 of a world
of 1, so a training run under ``mpiexec -n 2`` trained two unrelated copies without a word, and
``MPIPool`` waited out its 120 s start-up for ranks that all said they were rank 0. (Seen on a
GPU machine whose image links mpi4py to Open MPI while the mpich wheel's mpiexec came first.)
Here the wrong launcher is simulated by the variable Open MPI's mpirun sets, which MPICH ignores.
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

pytest.importorskip("mpi4py", reason="the MPI engine needs the [mpi] extra (mpi4py, mpich)")

from distframe._mpi_launch import _Job  # noqa: E402
from distframe.errors import BackendUnavailableError  # noqa: E402

pytestmark = pytest.mark.mpi
NEW_BACKEND = "from distframe.backends.mpi import MPICommunicationBackend; MPICommunicationBackend()"


def test_a_backend_under_another_mpis_launcher_names_the_mismatch():
    env = dict(os.environ, OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="1")
    proc = subprocess.run([sys.executable, "-c", NEW_BACKEND], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "BackendUnavailableError" in last
    assert "OMPI_COMM_WORLD_SIZE=2" in last and "world of 1" in last and "MPICH" in last, last


def test_a_backend_as_a_true_singleton_still_starts():
    """No launcher variables (or a launcher of one): a world of 1 is what was asked for."""
    env = {k: v for k, v in os.environ.items() if k not in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")}
    for extra in ({}, {"PMI_SIZE": "1"}):
        proc = subprocess.run([sys.executable, "-c", NEW_BACKEND + ".shutdown()"], env={**env, **extra},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr


def _fake_launcher(tmp_path, export: str):
    """A stand-in for another MPI's mpirun: it starts the ranks without MPICH's process manager."""
    fake = tmp_path / "mpirun"
    fake.write_text(f'#!/bin/sh\nn=$2; shift 2\nfor i in $(seq 1 $n); do {export} "$@" & done\nwait\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return str(fake)


def test_the_pool_reports_the_ranks_error_at_once(tmp_path):
    """The 120 s start-up limit would raise too, but saying only that the ranks did not start."""
    with pytest.raises(BackendUnavailableError, match=r"OMPI_COMM_WORLD_SIZE=2 .*world of 1"):
        _Job(_fake_launcher(tmp_path, "OMPI_COMM_WORLD_SIZE=$n"), 2)


def test_the_pool_refuses_two_rank_zeros(tmp_path, monkeypatch):
    """A launcher that exports nothing mpi4py's library reads: two singletons, both rank 0."""
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(BackendUnavailableError, match=r"two of the 2 ranks .* are rank 0"):
        _Job(_fake_launcher(tmp_path, ""), 2)
