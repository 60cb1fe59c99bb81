"""The same job under mpiexec (processes started by the launcher) and as a spawned Gloo world;
both give the losses the in-memory engine gives."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train.conftest import TINY, read_metrics, train

SHORT = ("--steps", "3", "--eval-every", "3", "--checkpoint-every", "3")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_file) -> list[dict]:
    return train(tmp_path_factory.mktemp("inmemory"), corpus_file, *SHORT, "--world-size", "2")


def _mpiexec() -> str | None:
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else shutil.which("mpiexec")


@pytest.mark.mpi
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or _mpiexec() is None,
                    reason="needs mpi4py and mpiexec (pip install 'distframe[mpi]')")
def test_under_mpiexec(tmp_path, corpus_file, reference):
    command = [_mpiexec(), "-n", "2", sys.executable, "-m", "distframe", "train", "--backend",
               "mpi", *TINY, *SHORT, "--data", corpus_file, "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("distframe train: step 3/3") == 1  # only rank 0 reports
    metrics = read_metrics(tmp_path)
    assert [m["train_loss"] for m in metrics] == pytest.approx(
        [m["train_loss"] for m in reference], abs=1e-6)
    assert (tmp_path / "checkpoints" / "step-3" / "metadata.json").exists()


@pytest.mark.gloo
def test_spawned_gloo_world(tmp_path, corpus_file, reference):
    metrics = train(tmp_path, corpus_file, *SHORT, "--backend", "gloo", "--world-size", "2",
                    "--strategy", "zero2")
    assert [m["train_loss"] for m in metrics] == pytest.approx(
        [m["train_loss"] for m in reference], abs=1e-6)
    assert (tmp_path / "checkpoints" / "step-3" / "metadata.json").exists()


@pytest.mark.parametrize("launcher_env", [{"PMI_RANK": "0", "PMI_SIZE": "2"},
                                          {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}])
@pytest.mark.parametrize("flags", [("--backend", "inmemory"), ("--optimizer", "elastic")])
def test_an_in_process_job_under_a_launcher_is_refused(tmp_path, corpus_file, monkeypatch, capsys,
                                                       launcher_env, flags):
    # `mpiexec -n 2 distframe train --backend inmemory` ran two unrelated one-rank jobs into one
    # --out (120 metrics records for 60 steps, config.json saying world_size 1), exit 0.
    from distframe.cli import main
    for name, value in launcher_env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    assert main(["train", *TINY, *SHORT, "--data", corpus_file, "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "starts its own" in err and "without" in err, err
    assert not out.exists()
