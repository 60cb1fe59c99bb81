"""A run whose launcher restarted its workers (torchrun sets TORCHELASTIC_RESTART_COUNT > 0 in
every worker it restarts, with the same command) continues from its latest checkpoint as --resume
would, instead of replacing its own checkpoints and training from step 1. Tested on in-memory
ranks with the variable set, as a restarted worker sees it."""
from __future__ import annotations

import dataclasses
import shutil

import pytest

from distframe import spawn, train
from distframe.cli import build_parser, main
from distframe.errors import ConfigError
from distframe.train_settings import resolve_config
from tests.train.conftest import TINY, read_metrics
from tests.train.conftest import train as train_run

FLAGS = ("--steps", "4", "--checkpoint-every", "2", "--eval-batches", "1", "--world-size", "2")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus_file):
    out = tmp_path_factory.mktemp("full") / "run"
    return out, train_run(out, corpus_file, *FLAGS)


def _died_after_step_3(run, out):
    """OUT as a worker's death during step 4 leaves it: checkpoint step-2, metrics to step 3."""
    shutil.copytree(run, out)
    shutil.rmtree(out / "checkpoints" / "step-4")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")


def _restart_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "restarted" in line]


def test_a_restarted_run_continues_from_its_latest_checkpoint(uninterrupted, tmp_path, corpus_file,
                                                              capsys, monkeypatch):
    run, full = uninterrupted
    out = tmp_path / "run"
    _died_after_step_3(run, out)
    kept = read_metrics(out)[:2]
    capsys.readouterr()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    resumed = train_run(out, corpus_file, *FLAGS)  # the same command, as torchrun reruns it
    err = capsys.readouterr().err
    assert resumed[:2] == kept  # steps 1-2 were not trained again (their wall times differ)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full, resumed):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-6)
    assert "replacing" not in err
    lines = _restart_lines(err)
    assert len(lines) == 1 and "TORCHELASTIC_RESTART_COUNT=1" in lines[0] and "step-2" in lines[0]


def test_a_run_restarted_before_its_first_checkpoint_starts_again(tmp_path, corpus_file, capsys,
                                                                   monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    metrics = train_run(tmp_path, corpus_file, *FLAGS)
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    lines = _restart_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "no checkpoint" in lines[0] and "step 1" in lines[0]


def test_a_restart_never_replaces_another_configurations_run(uninterrupted, tmp_path, corpus_file,
                                                             capsys, monkeypatch):
    """A first attempt that died before it replaced an earlier run of other settings in OUT left
    that run there: the restart refuses (one line) and deletes nothing."""
    run, full = uninterrupted
    out = tmp_path / "run"
    _died_after_step_3(run, out)
    capsys.readouterr()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    status = main(["train", *TINY, "--data", corpus_file, "--out", str(out), *FLAGS, "--lr", "5e-3"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert "--lr" in err and "another" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    assert len(read_metrics(out)) == 3


def test_without_a_restart_a_fresh_run_still_replaces_the_earlier_one(uninterrupted, tmp_path,
                                                                      corpus_file, capsys, monkeypatch):
    run, _ = uninterrupted
    out = tmp_path / "run"
    _died_after_step_3(run, out)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's first attempt
    capsys.readouterr()
    metrics = train_run(out, corpus_file, *FLAGS)
    assert metrics[0] != read_metrics(run)[0] and len(metrics) == 4
    assert "replacing the earlier run" in capsys.readouterr().err


def _config(corpus_file, out, *flags):
    """The TrainConfig that ``distframe train`` with the tiny settings resolves for ``flags``."""
    args = build_parser().parse_args(["train", *TINY, "--data", corpus_file, "--out", str(out), *flags])
    ignored = ("handler", "command", "debug", "config")
    return resolve_config({k: v for k, v in vars(args).items() if k not in ignored})


def test_launched_ranks_agree_on_continuing(uninterrupted, tmp_path, corpus_file, monkeypatch):
    """Launched ranks each see their own disk: one that finds the run's checkpoint makes them all
    continue (--resume's agreement on the step then stops them all if their disks differ), and
    one that finds another run there stops them all."""
    run, _ = uninterrupted
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")

    def ranks(*flags):
        def rank(backend):
            config = _config(corpus_file, run, *FLAGS, *flags)
            if backend.rank == 1:
                config = dataclasses.replace(config, out=str(tmp_path / "empty"))
            return train.continue_after_restart(config, backend)[0].resume
        return spawn(rank, 2)
    assert ranks() == [True, True]
    with pytest.raises(ConfigError, match="--lr"):
        ranks("--lr", "5e-3")
