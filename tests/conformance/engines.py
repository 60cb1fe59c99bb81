"""Runners that execute one rank function on every rank of an engine, for the conformance suite.

In-memory groups are threads made fresh per call (cheap). Gloo and MPI groups are persistent
worker processes (a ProcessPool / MPIPool) made once per test module, because starting a process
that imports torch costs seconds.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from distframe.launch import spawn


class InMemoryRunner:
    engine = "inmemory"

    def __init__(self, world_size: int, timeout: float = 60.0) -> None:
        self.world_size = world_size
        self.timeout = timeout

    def run(self, fn: Callable[..., Any], **kwargs: Any) -> list[Any]:
        return spawn(functools.partial(fn, **kwargs), self.world_size, "inmemory", timeout=self.timeout)

    def close(self) -> None:
        pass


class PoolRunner:
    """Wraps a persistent pool (ProcessPool for gloo, MPIPool for mpi)."""

    def __init__(self, engine: str, world_size: int, timeout: float = 60.0) -> None:
        self.engine = engine
        self.world_size = world_size
        if engine == "gloo":
            from distframe._process_launch import ProcessPool
            self._pool = ProcessPool(world_size, "gloo", timeout=timeout)
        elif engine == "mpi":
            from distframe._mpi_launch import MPIPool
            self._pool = MPIPool(world_size, timeout=timeout)
        else:
            raise ValueError(f"no pool for engine {engine!r}")

    def run(self, fn: Callable[..., Any], **kwargs: Any) -> list[Any]:
        return self._pool.run(fn, **kwargs)

    def close(self) -> None:
        self._pool.close()


def make_runner(spec: str):
    engine, world = spec.split("-")
    if engine == "inmemory":
        return InMemoryRunner(int(world))
    return PoolRunner(engine, int(world))
