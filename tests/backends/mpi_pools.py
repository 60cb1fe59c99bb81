"""A module-scoped MPIPool fixture, made once per test module and reused by its MPI tests (each
pool starts its ranks under mpiexec once: seconds)."""
from __future__ import annotations

import pytest


def mpi_pool_fixture(world_size: int, timeout: float):
    """``pool = mpi_pool_fixture(3, timeout=2.0)`` at a module's top level: a fixture named as
    assigned, skipped where mpi4py is missing."""
    @pytest.fixture(scope="module")
    def pool():
        pytest.importorskip("mpi4py", reason="the MPI engine needs the [mpi] extra (mpi4py, mpich)")
        from distframe._mpi_launch import MPIPool

        with MPIPool(world_size, timeout=timeout) as running:
            yield running
    return pool
