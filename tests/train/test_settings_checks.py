"""Settings that are valid but probably not what the user meant: warned about, not refused."""
from __future__ import annotations

import pytest

from distframe.cli import main
from distframe.errors import ConfigError
from distframe.train_config import TrainConfig
from distframe.train_settings import resolve_config
from tests.train.conftest import TINY, train


def _warnings(flags, toml_path=None):
    said: list[str] = []
    resolve_config(flags, toml_path, warn=said.append)
    return said


def test_warmup_longer_than_the_run_is_warned_about():
    """--warmup-steps 50 --steps 20: the rate climbs for the whole run and never reaches --lr."""
    said = _warnings({"warmup_steps": 50, "steps": 20})
    assert len(said) == 1 and "\n" not in said[0]
    assert "--warmup-steps 50" in said[0] and "--steps 20" in said[0]
    assert "never reaches" in said[0] and "at most 20" in said[0]


def test_warmup_from_a_toml_file_is_warned_about(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("warmup-steps = 8\nsteps = 5\n")
    assert len(_warnings({}, str(path))) == 1
    assert _warnings({"steps": 8}, str(path)) == []  # the peak is reached at the last step


@pytest.mark.parametrize("flags", [{"steps": 3}, {"steps": 3, "lr": 0.01}, {"warmup_steps": 3,
                                                                             "steps": 3}])
def test_no_warning_for_the_default_warmup_or_one_that_fits(flags):
    """The default warm-up (10 steps) is longer than short runs such as --steps 3: not the
    user's choice, so nothing is said."""
    assert _warnings(flags) == []


def test_a_resumed_run_is_not_warned_about_its_saved_warmup(tmp_path):
    """config.json holds every setting, the defaults too: a saved value is not one the user gave
    now (the run that saved it was warned when it started)."""
    import json
    saved = TrainConfig(steps=40, warmup_steps=30)
    (tmp_path / "config.json").write_text(json.dumps({"train": saved.to_json()}))
    assert _warnings({"resume": True, "out": str(tmp_path), "steps": 20}) == []


@pytest.mark.parametrize("value", [-1, 2.5, True, "3"])
def test_warmup_steps_must_be_a_whole_number_of_steps(value):
    with pytest.raises(ConfigError, match="--warmup-steps"):
        TrainConfig(warmup_steps=value)


def test_the_cli_says_it_once_when_the_run_starts(capsys, tmp_path, corpus_file):
    """Two in-memory ranks: one line, from rank 0."""
    train(tmp_path, corpus_file, "--steps", "2", "--warmup-steps", "4", "--world-size", "2",
          "--eval-batches", "1")
    warned = [line for line in capsys.readouterr().err.splitlines() if "--warmup-steps" in line]
    assert len(warned) == 1 and warned[0].startswith("distframe train: warning: --warmup-steps 4")


@pytest.mark.parametrize("optimizer", ["none", "async", "elastic"])
def test_the_warning_comes_before_training(capsys, monkeypatch, tmp_path, corpus_file, optimizer):
    """Said once the run has started, before its first step: a user who stops a long run (here
    at its first step) has read it. It used to come with the run's summary only."""
    from distframe.train_metrics import ProgressBar

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ProgressBar, "__init__", interrupted)  # the bar of the first step
    status = main(["train", *TINY, "--data", corpus_file, "--out", str(tmp_path / "run"), "--steps", "2",
                   "--warmup-steps", "4", "--world-size", "2", "--optimizer", optimizer])
    err = capsys.readouterr().err
    assert status != 0 and "interrupted" in err
    warned = [line for line in err.splitlines() if "--warmup-steps 4" in line]
    assert len(warned) == 1 and err.index(warned[0]) < err.index("interrupted")


def test_a_run_refused_for_bad_input_still_reports_one_line(capsys, tmp_path, corpus_file):
    """The warning comes once the run has trained: bad input found before that (here an
    unwritable --out) stays one line."""
    out = tmp_path / "file"
    out.write_text("")
    status = main(["train", *TINY, "--data", corpus_file, "--out", str(out / "run"), "--steps", "2",
                   "--warmup-steps", "4", "--world-size", "1"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and "warning" not in lines[0], lines


def test_ranks_other_than_zero_say_nothing(capsys, monkeypatch):
    """Under mpiexec or torchrun every rank runs the command; only rank 0's result is reported."""
    from distframe import train as train_module
    from distframe.train_loop import TrainResult
    result = TrainResult(step=2, train_loss=1.0, val_loss=1.0, tokens_per_s=1.0,
                         peak_memory_bytes=0, wall_s=1.0, out="run", checkpoint=None, rank=1)
    monkeypatch.setattr(train_module, "run", lambda config, **_: result)
    assert main(["train", "--steps", "2", "--warmup-steps", "4", "--world-size", "1"]) == 0
    assert capsys.readouterr().err == ""
