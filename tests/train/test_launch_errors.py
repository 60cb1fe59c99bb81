"""Errors in processes that a launcher started: bad or partial launcher variables are one line
(status 2) before any rendezvous; a rank whose own input is bad says so, naming its rank, and the
job ends at once (under mpiexec a rank that fails before MPI_Init aborts the job, which left the
others waiting in MPI_Init for ever); peers of a rank that raised hear that it failed; a stop
signal ends a rank blocked in the rendezvous. Every process started here has a time limit."""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distframe.cli import main
from distframe.launch import detect_launcher
from tests.train.conftest import TINY
from tests.train.test_launchers import _mpiexec

ONE_STEP = ("--steps", "1", "--warmup-steps", "1", "--eval-every", "0", "--checkpoint-every", "0")
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
MPI_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID")
requires_mpi = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or _mpiexec() is None,
                                  reason="needs mpi4py and mpiexec (pip install 'distframe[mpi]')")


@pytest.fixture
def launcher_env(monkeypatch):
    """Sets the given variables in a clean launcher environment (none of either launcher's)."""
    for name in (*TORCHRUN_VARIABLES, *MPI_VARIABLES):
        monkeypatch.delenv(name, raising=False)

    def set_env(variables: dict[str, str]) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
    return set_env


def _clean_env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (*TORCHRUN_VARIABLES, *MPI_VARIABLES)}
    return {**env, "OMP_NUM_THREADS": "1", **variables}


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """The exit status and stderr of ``proc`` (started in a session of its own); fails the test
    if it runs past ``timeout`` seconds. Its process group is killed either way."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"still running after {timeout} s; stderr: {err[-2000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, err


def _run(command: list[str], env: dict[str, str] | None = None, timeout: float = 20) -> tuple[int, str]:
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or _clean_env(), start_new_session=True)
    return _finish(proc, timeout)


def _errors(err: str) -> list[str]:
    """The error lines in ``err`` (after any progress bar that shares their line)."""
    return [line[line.index("distframe: error"):] for line in err.splitlines() if "distframe: error" in line]


def _train(corpus: str, out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "distframe", "train", *TINY, *ONE_STEP, "--data", corpus,
            "--out", str(out), *flags]


# ---- the launcher's variables -------------------------------------------------------------------
@pytest.mark.parametrize("variables,missing", [
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "MASTER_ADDR"),
    ({"RANK": "0"}, "WORLD_SIZE, MASTER_ADDR"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "RANK")])
def test_some_of_torchruns_variables_are_refused(tmp_path, corpus_file, capsys, launcher_env,
                                                 variables, missing):
    # Each process took itself for a whole run and trained it, all of them into one --out.
    launcher_env(variables)
    out = tmp_path / "out"
    assert main(["train", *TINY, *ONE_STEP, "--data", corpus_file, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{missing} not set" in err[0], err
    assert not out.exists()


def test_mpis_variables_win_over_stray_torchrun_ones():
    assert detect_launcher({"PMI_RANK": "0", "PMI_SIZE": "2", "WORLD_SIZE": "2"}) == "mpi"


@pytest.mark.parametrize("variables,named", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "LOCAL_RANK"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT")])
def test_bad_launcher_variables_are_one_line(tmp_path, corpus_file, capsys, launcher_env, variables,
                                              named):
    launcher_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **variables})
    status = main(["train", *TINY, *ONE_STEP, "--data", corpus_file, "--out", str(tmp_path / "out"),
                   "--backend", "gloo", "--timeout", "5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and f"{named}=" in err[0], err


def test_a_master_port_in_use_is_one_line(tmp_path, corpus_file, capsys, launcher_env):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        launcher_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        status = main(["train", *TINY, *ONE_STEP, "--data", corpus_file, "--out", str(tmp_path / "out"),
                       "--backend", "gloo", "--timeout", "5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and f"MASTER_PORT {port}" in err[0] and "another" in err[0], err


def test_a_rank_out_of_range_fails_at_once(tmp_path, corpus_file):
    # It waited for the whole --timeout in the rendezvous, then gave a traceback.
    env = _clean_env(RANK="2", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    status, err = _run(_train(corpus_file, tmp_path / "out", "--backend", "gloo", "--timeout", "60"),
                       env)
    assert status == 2 and len(_errors(err)) == 1 and "RANK=2" in err, err


# ---- a rank's own bad input -----------------------------------------------------------------------
@pytest.mark.mpi
@requires_mpi
@pytest.mark.parametrize("on_rank_0", [True, False], ids=["every-rank", "rank-1-only"])
def test_missing_data_before_mpi_init_ends_the_job(tmp_path, corpus_file, on_rank_0):
    """Rank 1 cannot see --data (a node's local disk without it): it exited 2 without a word and
    rank 0 waited in MPI_Init for ever. Where every rank lacks it, rank 0 alone reports it."""
    missing = str(tmp_path / "missing.txt")
    rank_0 = _train(missing if on_rank_0 else corpus_file, tmp_path / "out", "--backend", "mpi")
    rank_1 = _train(missing, tmp_path / "out", "--backend", "mpi")
    status, err = _run([_mpiexec(), "-n", "1", *rank_0, ":", "-n", "1", *rank_1])
    errors = _errors(err)
    assert status == 2 and len(errors) == 1 and "missing.txt" in errors[0], err
    assert ("[rank 1]" in errors[0]) != on_rank_0, err


@pytest.mark.mpi
@requires_mpi
def test_data_too_short_on_one_rank_is_named(tmp_path, corpus_file):
    # Rank 1 stayed quiet, and rank 0 said only that rank 1 had left as if its function returned.
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    rank_0 = _train(corpus_file, tmp_path / "out", "--backend", "mpi")
    rank_1 = _train(str(short), tmp_path / "out", "--backend", "mpi")
    status, err = _run([_mpiexec(), "-n", "1", *rank_0, ":", "-n", "1", *rank_1])
    errors = _errors(err)
    assert status == 2 and len(errors) == 1 and "rank 1" in errors[0] and "short.txt" in errors[0], err
    assert "returned" not in err


@pytest.mark.mpi
@requires_mpi
def test_bad_input_every_rank_finds_once_started_is_one_line(tmp_path, corpus_file):
    # Found after the backend has started, on every rank: rank 0 reports it, the others do not.
    rank = _train(corpus_file, tmp_path / "out", "--backend", "mpi", "--batch-size", "7")
    status, err = _run([_mpiexec(), "-n", "2", *rank])
    errors = _errors(err)
    assert status == 2 and len(errors) == 1 and "--batch-size 7" in errors[0], err
    assert "[rank" not in errors[0], err


FAIL_ON_RANK_1 = """
import os, sys
from distframe import train_loop
from distframe.errors import ConfigError
if os.environ.get("RANK", os.environ.get("PMI_RANK")) == "1":
    def learning_rate(config, step):
        raise ConfigError("--out: this node's disk is read-only; injected")
    train_loop.learning_rate = learning_rate
from distframe.cli import entry_point
sys.argv[0] = "distframe"
entry_point()
"""


@pytest.mark.parametrize("launcher", [pytest.param("mpiexec", marks=[pytest.mark.mpi, requires_mpi]),
                                      "torchrun"])
def test_a_rank_that_fails_alone_says_why_and_its_peers_hear_it_failed(tmp_path, corpus_file, launcher):
    driver = tmp_path / "fail_on_rank_1.py"
    driver.write_text(FAIL_ON_RANK_1)
    flags = [*TINY, *ONE_STEP, "--data", corpus_file, "--out", str(tmp_path / "out"), "--timeout", "30"]
    if launcher == "mpiexec":
        command = [_mpiexec(), "-n", "2", sys.executable, str(driver), "train", *flags, "--backend", "mpi"]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-port", str(_free_port()), str(driver), "train", *flags, "--backend", "gloo"]
    status, err = _run(command)
    errors = _errors(err)
    assert status != 0 and any("[rank 1]" in e and "injected" in e for e in errors), err
    assert any("rank 1" in e and "raised" in e for e in errors if "[rank 1]" not in e), err
    assert "returned" not in err, err


def test_a_rank_that_fails_before_the_rendezvous_under_torchrun_says_why(tmp_path, corpus_file):
    driver = tmp_path / "missing_on_rank_1.py"
    driver.write_text(FAIL_ON_RANK_1.replace(
        "train_loop.learning_rate = learning_rate",
        f"sys.argv[sys.argv.index('--data') + 1] = {str(tmp_path / 'missing.txt')!r}"))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), str(driver), "train", *TINY, *ONE_STEP, "--data", corpus_file,
               "--out", str(tmp_path / "out"), "--backend", "gloo", "--timeout", "30"]
    status, err = _run(command)
    errors = _errors(err)
    assert status != 0 and len(errors) == 1 and "[rank 1]" in errors[0] and "missing.txt" in errors[0], err


# ---- stop signals ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _silent_store():
    """A listening socket that takes connections and never answers: a rendezvous blocks on it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(20)
    return server


def test_sigterm_ends_a_rank_blocked_in_the_rendezvous(tmp_path, corpus_file):
    with _silent_store() as server:
        env = _clean_env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(server.getsockname()[1]))
        proc = subprocess.Popen(_train(corpus_file, tmp_path / "out", "--backend", "gloo", "--timeout", "60"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        with _connected(server, proc):  # the rank is in TCPStore's C++ client now
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            status, err = _finish(proc, timeout=10)
    assert status == -signal.SIGTERM, err


def _connected(server: socket.socket, proc: subprocess.Popen) -> socket.socket:
    """The connection ``proc`` made to ``server``; the test fails (and ``proc`` is killed) without one."""
    try:
        connection, _ = server.accept()
    except socket.timeout:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"no connection: {proc.communicate()[1][-2000:]}")
    return connection


BLOCKED_IN_C = """
import datetime, os, sys
import torch.distributed as dist
from distframe import cli, train_cli
def train_command(args):  # a call that blocks in C++, where a Python signal handler never runs
    port = int(os.environ["STORE_PORT"])
    dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    return 0
train_cli.train_command = train_command
sys.argv = ["distframe", "train"]
cli.entry_point()
"""


def test_a_second_sigterm_kills_a_process_whose_handler_cannot_run(tmp_path):
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED_IN_C)
    with _silent_store() as server:
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=_clean_env(STORE_PORT=str(server.getsockname()[1])),
                                start_new_session=True)
        with _connected(server, proc):
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            time.sleep(1)
            assert proc.poll() is None  # the first one waits for the handler (the documented path)
            proc.send_signal(signal.SIGTERM)
            status, err = _finish(proc, timeout=10)
    assert status < 0, err


# ---- notes -----------------------------------------------------------------------------------------
def test_the_world_size_note_names_the_launcher_command(tmp_path, monkeypatch):
    from distframe import train
    from distframe.train_config import TrainConfig
    monkeypatch.setattr(train.train_checkpoint, "saved_world_size", lambda out: 2)
    monkeypatch.setattr(train.train_checkpoint, "latest_checkpoint", lambda out: None)
    one = TrainConfig(out=str(tmp_path), resume=True, world_size=1, batch_size=8)
    (note,) = train.world_size_note(one, False, "torchrun")
    assert "on the 1 rank torchrun started" in note and "start 2 ranks with torchrun" in note, note
    four = TrainConfig(out=str(tmp_path), resume=True, world_size=4, batch_size=8)
    (note,) = train.world_size_note(four, False, "mpi")
    assert "the 4 ranks mpiexec started" in note and "start 2 ranks with mpiexec" in note, note
