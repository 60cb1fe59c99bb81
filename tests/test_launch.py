"""spawn / init_backend dispatch that needs no second process (but one script, run to be interrupted)."""
import datetime
import os
import re
import subprocess
import sys

import pytest
import torch

from distframe import init_backend, spawn
from distframe.backends import InMemoryCommunicationBackend
from distframe.errors import ConfigError
from distframe.launch import detect_launcher


def test_spawn_returns_results_in_rank_order():
    assert spawn(lambda b: (b.rank, b.world_size), 3) == [(0, 3), (1, 3), (2, 3)]


@pytest.mark.parametrize("world_size", [0, -1, 2.0, True, "2"])
def test_spawn_refuses_a_world_size_that_is_not_a_positive_int(world_size):
    # True is an int to Python: it ran one rank.
    with pytest.raises(ConfigError, match="world_size must be a positive int"):
        spawn(lambda b: None, world_size)


def test_spawn_passes_timeout_to_backends():
    assert spawn(lambda b: b.timeout, 2, timeout=7.5) == [7.5, 7.5]


@pytest.mark.parametrize("timeout,says", [
    (None, "NoneType None"), ("5", "str '5'"), (True, "bool True"),
    (datetime.timedelta(seconds=5), "total_seconds()"),
])
def test_spawn_refuses_a_timeout_that_is_not_a_number_of_seconds(timeout, says):
    # A string or None gave a bare TypeError from a comparison inside each rank's backend, and
    # True ran with a timeout of 1 s.
    ran = []
    for backend in ("inmemory", "gloo"):
        with pytest.raises(ValueError, match=r"timeout must be a number of seconds .*" + re.escape(says)):
            spawn(ran.append, 2, backend, timeout=timeout)
    assert ran == []


@pytest.mark.parametrize("env,expected", [
    ({}, None),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "mpi"),
    ({"OMPI_COMM_WORLD_RANK": "1"}, "mpi"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "torchrun"),
    ({"MASTER_ADDR": "n0"}, None),  # job scripts export it for other tools too
    # A torchrun per node started by mpirun or srun: its workers inherit the MPI launcher's
    # variables, and MPI_Init failed in them (or each took itself for a world of one).
    ({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "n0", "OMPI_COMM_WORLD_RANK": "0"}, "torchrun"),
    ({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "n0", "PMIX_RANK": "0", "PMI_RANK": "0"}, "torchrun"),
])
def test_detect_launcher(env, expected):
    assert detect_launcher(env) == expected


def test_some_of_torchruns_variables_are_a_config_error():
    # Taken for no launcher, each process trained a run of its own into one --out.
    with pytest.raises(ConfigError, match="RANK set but WORLD_SIZE, MASTER_ADDR not set"):
        detect_launcher({"RANK": "0"})


def test_init_backend_without_a_launcher_is_a_single_rank(monkeypatch):
    for var in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID", "RANK"):
        monkeypatch.delenv(var, raising=False)
    with init_backend("auto", timeout=5) as b:
        assert isinstance(b, InMemoryCommunicationBackend) and (b.rank, b.world_size) == (0, 1)
        assert b.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]


def test_init_backend_rejects_unknown_names():
    with pytest.raises(ConfigError, match="unknown backend"):
        init_backend("smoke-signals")


def test_gloo_outside_torchrun_says_how_to_start(monkeypatch):
    from distframe.errors import BackendUnavailableError
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "PMI_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(BackendUnavailableError, match="torchrun"):
        init_backend("gloo")


@pytest.mark.parametrize("gpus,local_ranks,expected", [
    (0, 2, "gloo"), (1, 2, "gloo"), (2, 2, "nccl"), (8, 4, "nccl"), (1, 1, "nccl")])
def test_auto_under_torchrun_picks_nccl_only_with_a_gpu_per_local_rank(monkeypatch, gpus, local_ranks,
                                                                      expected):
    # NCCL refuses two ranks on one GPU: with fewer GPUs than processes on the node, Gloo.
    from distframe.backends import torch_dist
    for var in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(local_ranks))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    monkeypatch.setattr(torch_dist, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(torch_dist, "from_environment", lambda name, **kw: name)
    monkeypatch.setattr("distframe.launch._departs_with_script", lambda backend: backend)
    assert init_backend("auto") == expected


@pytest.mark.parametrize("error", [RuntimeError("can't start new thread"), KeyboardInterrupt()])
def test_a_rank_thread_that_cannot_start_stops_those_started(monkeypatch, error):
    """Starting rank 2's thread fails (no thread left for it, or Ctrl-C while starting): spawn
    raises that at once, and ranks 0 and 1, already waiting for rank 2 in a barrier, have ended
    too. Before, they stayed blocked until the backend's timeout, after spawn had returned."""
    import threading
    import time
    start = threading.Thread.start

    def failing_start(thread):
        if thread.name == "distframe-rank2":
            raise error
        start(thread)
    monkeypatch.setattr(threading.Thread, "start", failing_start)
    began = time.monotonic()
    with pytest.raises(type(error)):
        spawn(lambda b: b.barrier(), 3, timeout=60)
    assert time.monotonic() - began < 10
    assert not [t.name for t in threading.enumerate() if t.name.startswith("distframe-rank")]


CTRL_C_DURING_SPAWN = """
import os, signal, threading, time
import torch
from distframe import spawn

def rank(backend):
    end = time.monotonic() + (1.5 if backend.rank == 0 else 0.0)  # rank 0 computes, rank 1 waits
    x = torch.randn(32, 32)
    while time.monotonic() < end:
        x = torch.tanh(x @ x.T / 32)
    backend.barrier()

threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
try:
    spawn(rank, 2)
except KeyboardInterrupt:
    print("left:", [t.name for t in threading.enumerate() if t.name.startswith("distframe-rank")])
    raise
"""


def test_ctrl_c_during_spawn_returns_once_every_rank_thread_has_finished():
    # Python 3.11: once Thread.join() was interrupted, is_alive() reads False for a thread still
    # running, so spawn's join(timeout=5) returned at once with rank 0 computing: spawn raised at
    # 0.3 s with a rank thread left, and the process aborted at exit ("terminate called without an
    # active exception", status 134 where an interrupt gives 130).
    done = subprocess.run([sys.executable, "-c", CTRL_C_DURING_SPAWN], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "left: []" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert done.returncode in (130, -2), (done.returncode, done.stderr[-2000:])  # by SIGINT
