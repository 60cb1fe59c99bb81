"""``--resume`` keeps the run's model: a flag that would change its shape or vocabulary is bad
input (exit status 2, one line naming the flag, its value and the run's), found before anything
is built; flags that may change on resume (strategy, world size, steps, schedule) still work."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from distframe.cli import main
from tests.train.conftest import TINY, read_metrics, train
from tests.train.test_bad_input import _fails_with


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, corpus_file) -> Path:
    """One step of the tiny model (2 layers, d_model 32, 2 heads, seq_len 32), checkpointed."""
    out = tmp_path_factory.mktemp("resume_model") / "run"
    train(out, corpus_file, "--steps", "1", "--world-size", "1", "--eval-batches", "1")
    return out


@pytest.fixture
def run_copy(tiny_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(tiny_run, copy)
    return copy


@pytest.mark.parametrize(("flags", "needle"), [
    (["--layers", "3"], "--layers 3 differs from the run's 2"),
    (["--d-model", "64"], "--d-model 64 differs from the run's 32"),
    (["--heads", "4"], "--heads 4 differs from the run's 2"),
    (["--seq-len", "64", "--segment-lengths", "16,32,64"], "--seq-len 64 differs from the run's 32"),
    (["--segment-lengths", "4,16,32"], "--segment-lengths 4,16,32 differs from the run's 8,16,32"),
    (["--dilation-rates", "1,2,2"], "--dilation-rates 1,2,2 differs from the run's 1,2,4"),
    (["--preset", "small"], "--preset small differs from the run's tiny"),
])
def test_a_model_flag_that_differs_from_the_run(capsys, run_copy, flags, needle):
    saved = (run_copy / "config.json").read_text()
    line = _fails_with(capsys, ["train", *TINY, "--out", str(run_copy), "--resume", "--steps", "2", *flags],
                       needle, f"(in {run_copy / 'config.json'})", "a resumed run keeps its model",
                       "start a new --out")
    assert f"drop {flags[0]}" in line
    assert (run_copy / "config.json").read_text() == saved
    assert len(read_metrics(run_copy)) == 1


def test_a_model_setting_in_a_config_file(capsys, run_copy, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("layers = 4\n")
    _fails_with(capsys, ["train", "--out", str(run_copy), "--resume", "--config", str(config)],
                "--layers 4 differs from the run's 2")


def test_data_with_another_vocabulary(capsys, run_copy, tmp_path):
    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 1000, 20_000).astype(np.uint16).tofile(tokens)
    tokens_flags = ["--data", str(tokens), "--token-dtype", "uint16"]
    line = _fails_with(capsys, ["train", "--out", str(run_copy), "--resume", "--steps", "2", *tokens_flags],
                       "--data", "vocabulary of 1000", "the run's 256", "a resumed run keeps its model")
    assert "--token-dtype uint16" in line


def test_flags_that_may_change_on_resume(run_copy):
    """The model flags at the run's values (the preset's or given), with another strategy, world
    size, step count and learning rate: the run goes on."""
    metrics = train(run_copy, json.loads((run_copy / "config.json").read_text())["train"]["data"],
                    "--resume", "--steps", "2", "--strategy", "zero2", "--world-size", "2",
                    "--layers", "2", "--lr", "5e-3")
    assert [m["step"] for m in metrics] == [1, 2]
    status = main(["train", "--out", str(run_copy), "--resume", "--steps", "3", "--preset", "tiny"])
    assert status == 0


@pytest.mark.gloo
def test_under_torchrun_the_ranks_agree_and_rank_0_reports(run_copy, tmp_path):
    """Launched ranks read the data themselves, each its own OUT/config.json: they agree on the
    verdict, and rank 0 says it in one line (exit status 2)."""
    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 1000, 20_000).astype(np.uint16).tofile(tokens)
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("needs torchrun beside the interpreter")
    command = [str(torchrun), "--nproc-per-node", "2", "-m", "distframe", "train", "--backend", "gloo",
               "--out", str(run_copy), "--resume", "--steps", "2", "--data", str(tokens),
               "--token-dtype", "uint16"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    reported = [line for line in result.stderr.splitlines() if line.startswith("distframe: error")]
    assert len(reported) == 1, result.stderr[-3000:]
    assert "ConfigError: --data" in reported[0] and "vocabulary of 1000" in reported[0]
    assert "exitcode  : 2" in result.stderr
