"""Settings that are valid but probably not what the user meant: warned about, not refused."""
from __future__ import annotations

import pytest

from distframe.cli import main
from distframe.errors import ConfigError
from distframe.train_config import TrainConfig
from distframe.train_settings import resolve_config


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


@pytest.mark.parametrize(("rank", "warned"), [("0", True), ("1", False)])
def test_the_warning_is_printed_by_rank_zero_only(capsys, monkeypatch, tmp_path, rank, warned):
    """Under torchrun every rank resolves the settings; one line, from rank 0. (--optimizer
    elastic under a launcher is then refused before any backend starts, which ends the test.)"""
    for name, value in (("RANK", rank), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    status = main(["train", "--optimizer", "elastic", "--out", str(tmp_path), "--steps", "4",
                   "--warmup-steps", "6"])
    err = capsys.readouterr().err
    assert status == 2
    assert ("warning: --warmup-steps 6" in err) == warned, err
