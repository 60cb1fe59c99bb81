"""Runners that execute one rank function on every rank of an engine, for the conformance suite.

In-memory groups are threads made fresh per call (cheap). Gloo, NCCL and MPI groups are
persistent worker processes (a ProcessPool / MPIPool) made once per test module, because starting
a process that imports torch costs seconds. A spec ``engine-world-cuda`` runs the checks with
their inputs on the rank's GPU (see ``oracle.inputs_on``).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from distframe.launch import spawn


def on_device(backend, fn: Callable[..., Any], device: str, **kwargs: Any) -> Any:
    """Runs the check ``fn`` with this rank's inputs on ``device`` (importable: pools pickle it)."""
    from tests.conformance.oracle import inputs_on
    if device == "cuda":
        own = getattr(backend, "_device", None)  # an NCCL rank's own GPU
        device = str(own) if own is not None and own.type == "cuda" else "cuda:0"
    with inputs_on(device):
        return fn(backend, **kwargs)


class OnDevice:
    """A runner whose checks take their inputs on ``device``."""

    def __init__(self, runner: Any, device: str) -> None:
        self.runner, self.device = runner, device
        self.engine, self.world_size = runner.engine, runner.world_size

    def run(self, fn: Callable[..., Any], **kwargs: Any) -> list[Any]:
        return self.runner.run(functools.partial(on_device, fn=fn, device=self.device), **kwargs)

    def close(self) -> None:
        self.runner.close()


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
    """Wraps a persistent pool (ProcessPool for gloo and nccl, MPIPool for mpi)."""

    def __init__(self, engine: str, world_size: int, timeout: float = 60.0) -> None:
        self.engine = engine
        self.world_size = world_size
        if engine in ("gloo", "nccl"):
            from distframe._process_launch import ProcessPool
            self._pool = ProcessPool(world_size, engine, timeout=timeout)
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
    engine, world, *device = spec.split("-")
    runner = InMemoryRunner(int(world)) if engine == "inmemory" else PoolRunner(engine, int(world))
    return OnDevice(runner, device[0]) if device else runner
