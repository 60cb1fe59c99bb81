"""``--optimizer compressed | async | elastic`` end to end on the in-memory engine: the identity
compressor trains DDP's curve, PowerSGD learns, a round-robin asynchronous run completes and
repeats itself, and the elastic demo survives a failure and a join with the outputs of any run."""
from __future__ import annotations

import json
import shutil

import pytest

from tests.train.conftest import train

STEPS = 6
FLOAT64 = ("--dtype", "float64", "--steps", str(STEPS), "--eval-every", "3")


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, corpus_file):
    return train(tmp_path_factory.mktemp("ddp"), corpus_file, *FLOAT64, "--world-size", "2")


def test_identity_compressor_equals_ddp(ddp, tmp_path, corpus_file):
    metrics = train(tmp_path, corpus_file, *FLOAT64, "--world-size", "2",
                    "--optimizer", "compressed", "--compressor", "none")
    for a, b in zip(ddp, metrics, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-8)
        if a["val_loss"] is not None:
            assert b["val_loss"] == pytest.approx(a["val_loss"], abs=1e-8)


def test_powersgd_learns(tmp_path, corpus_file):
    metrics = train(tmp_path, corpus_file, "--world-size", "2", "--steps", "12", "--eval-every",
                    "4", "--optimizer", "compressed", "--compressor", "powersgd",
                    "--powersgd-rank", "2", "--powersgd-start", "2")
    val = [m["val_loss"] for m in metrics if m["val_loss"] is not None]
    assert len(val) == 3 and val[-1] < val[0] - 0.1
    assert (tmp_path / "checkpoints" / "step-12" / "metadata.json").exists()


@pytest.mark.parametrize("compressor", ["int8", "topk"])
def test_compressed_resume_equals_uninterrupted(tmp_path, corpus_file, compressor):
    """The README's promise for --resume holds for lossy compressors too: their residuals and
    any random state they draw from (int8's stochastic rounding) are in the checkpoint."""
    flags = (*FLOAT64, "--world-size", "2", "--optimizer", "compressed", "--compressor",
             compressor, "--checkpoint-every", "3")
    full = train(tmp_path / "full", corpus_file, *flags)
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / f"step-{STEPS}")
    resumed = train(tmp_path / "resumed", corpus_file, "--resume")
    assert [(m["train_loss"], m["val_loss"]) for m in resumed] == \
        [(m["train_loss"], m["val_loss"]) for m in full]


def test_async_round_robin_completes_and_repeats(tmp_path, corpus_file, capsys):
    flags = (*FLOAT64, "--world-size", "3", "--optimizer", "async", "--round-robin",
             "--max-staleness", "1")
    first = train(tmp_path / "a", corpus_file, *flags)
    err = capsys.readouterr().err
    assert "async: 6 updates" in err
    assert f"{STEPS}/{STEPS}" in err  # the bar counts the run's updates, not one worker's
    second = train(tmp_path / "b", corpus_file, *flags)
    assert [m["step"] for m in first] == list(range(1, STEPS + 1))
    assert [m["train_loss"] for m in first] == [m["train_loss"] for m in second]
    assert first[-1]["val_loss"] == second[-1]["val_loss"] < first[0]["train_loss"]
    assert all(m["val_loss"] is None for m in first[:-1])
    assert (tmp_path / "a" / "checkpoints" / f"step-{STEPS}" / "metadata.json").exists()
    resumed = train(tmp_path / "a", corpus_file, "--resume", "--steps", "8", "--optimizer",
                    "none", "--world-size", "1")  # the server's state, resumed under DDP
    assert [m["step"] for m in resumed] == list(range(1, 9))


def test_elastic_demo_fails_joins_and_finishes(tmp_path, corpus_file, capsys):
    metrics = train(tmp_path, corpus_file, *FLOAT64, "--world-size", "2", "--batch-size", "6",
                    "--optimizer", "elastic", "--elastic-schedule", "4:3", "--fail-at", "2")
    err = capsys.readouterr().err
    assert "worker 1 failed" in err  # the last of two fails after step 2, one goes on
    assert "elastic: world 1 (workers [0]) from step 2" in err
    assert "elastic: world 3 (workers [0, 2, 3]) from step 4" in err
    assert "finished step 6 with world size 3" in err
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert metrics[-1]["val_loss"] < metrics[0]["train_loss"]
    assert json.loads((tmp_path / "config.json").read_text())["train"]["optimizer"] == "elastic"
    assert (tmp_path / "checkpoints" / f"step-{STEPS}" / "metadata.json").exists()


def test_elastic_resume_logs_the_step_it_continues_from(tmp_path, corpus_file, capsys):
    flags = ("--world-size", "2", "--optimizer", "elastic", "--eval-every", "0")
    train(tmp_path, corpus_file, *flags, "--steps", "2")
    capsys.readouterr()
    metrics = train(tmp_path, corpus_file, *flags, "--steps", "3", "--resume")
    err = capsys.readouterr().err
    assert "from step 2, restored from checkpoint" in err
    assert "elastic: workers [0, 1] from step 2: finished" in err and "from step 0" not in err
    assert [m["step"] for m in metrics] == [1, 2, 3]


def test_elastic_resume_starts_with_the_world_the_schedule_had_reached(tmp_path, corpus_file, capsys):
    """After step 2 the schedule makes the world 4; a run resumed at step 3 continues with 4
    workers, not the --world-size the run started with."""
    flags = ("--world-size", "2", "--batch-size", "4", "--optimizer", "elastic",
             "--elastic-schedule", "2:4", "--eval-every", "0")
    train(tmp_path, corpus_file, *flags, "--steps", "3")
    capsys.readouterr()
    metrics = train(tmp_path, corpus_file, *flags, "--steps", "4", "--resume")
    err = capsys.readouterr().err
    assert "elastic: world 4 (workers [0, 1, 2, 3]) from step 3, restored from checkpoint" in err
    assert "finished step 4 with world size 4" in err
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
