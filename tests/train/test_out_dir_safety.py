"""A fresh run in --out replaces an earlier distframe run's metrics and checkpoints and nothing
else; an OUT holding run files that distframe cannot tell are its own is refused in one line, and
so is a directory or file in the way of what the run writes (not an OSError's traceback)."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from distframe.errors import ConfigError
from distframe.train_config import TrainConfig
from distframe.train_metrics import MetricsLog
from tests.train.conftest import TINY, train
from tests.train.test_bad_input import _fails_with

FLAGS = ("--world-size", "1", "--eval-batches", "1")


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_a_fresh_run_replaces_only_the_earlier_runs_checkpoints(tmp_path, corpus_file, capsys):
    """It deleted all of OUT/checkpoints (shutil.rmtree), another tool's files included."""
    out = tmp_path / "run"
    train(out, corpus_file, "--steps", "2", "--checkpoint-every", "1", *FLAGS)
    checkpoints = out / "checkpoints"
    (checkpoints / "best_model.pt").write_text("precious")
    (checkpoints / "notes").mkdir()
    (checkpoints / "notes" / "a.txt").write_text("mine")
    (checkpoints / "step-9").mkdir()  # named like a checkpoint, but holding other files
    (checkpoints / "step-9" / "readme.txt").write_text("not a checkpoint")
    capsys.readouterr()
    metrics = train(out, corpus_file, "--steps", "1", *FLAGS)
    err = capsys.readouterr().err
    assert "replacing the earlier run" in err and "best_model.pt" in err
    assert [m["step"] for m in metrics] == [1]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best_model.pt", "notes", "step-1", "step-9"]
    assert (checkpoints / "best_model.pt").read_text() == "precious"
    assert (checkpoints / "notes" / "a.txt").read_text() == "mine"
    assert (checkpoints / "step-9" / "readme.txt").read_text() == "not a checkpoint"


@pytest.mark.parametrize(("files", "named"), [
    ({"checkpoints/best_model.pt": "precious", "metrics.jsonl": '{"epoch": 1}\n'},
     ["metrics.jsonl", "checkpoints/best_model.pt", "no config.json"]),
    ({"config.json": '{"epoch": 1}', "checkpoints/model.pt": "weights"},
     ["config.json", "checkpoints/model.pt", "not one distframe train wrote"]),
    # a checkpoint-like directory whose run's config.json is gone: not provably distframe's
    ({"checkpoints/step-2/metadata.json": "{}"}, ["checkpoints/step-2", "no config.json"]),
])
def test_an_out_holding_files_distframe_did_not_write_is_refused(capsys, tmp_path, corpus_file,
                                                                  files, named):
    out = tmp_path / "other"
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    before = _files(out)
    _fails_with(capsys, ["train", *TINY, "--data", corpus_file, "--out", str(out), "--steps", "1",
                         *FLAGS], f"--out {out} holds", "another --out", *named)
    assert _files(out) == before


@pytest.mark.parametrize("name", ["metrics.jsonl", "config.json", "loss.png"])
def test_a_directory_in_place_of_a_run_file(capsys, tmp_path, corpus_file, name):
    """IsADirectoryError's traceback, from inside a rank (metrics.jsonl: after the first step)."""
    out = tmp_path / "run"
    (out / name).mkdir(parents=True)
    _fails_with(capsys, ["train", *TINY, "--data", corpus_file, "--out", str(out), "--steps", "1",
                         *FLAGS], f"--out {out}", f"{out / name} is a directory", "move it away")


def test_a_file_in_place_of_the_checkpoints_directory(capsys, tmp_path, corpus_file):
    """The run trained until its first checkpoint, then failed with an OSError's traceback."""
    out = tmp_path / "run"
    train(out, corpus_file, "--steps", "1", *FLAGS)
    capsys.readouterr()
    for resume in ((), ("--resume", "--steps", "2")):
        os.replace(out / "checkpoints", tmp_path / "moved")
        (out / "checkpoints").write_text("in the way")
        _fails_with(capsys, ["train", *TINY, "--data", corpus_file, "--out", str(out), "--steps", "1",
                             *FLAGS, *resume], f"--out {out}", "checkpoints is a file")
        (out / "checkpoints").unlink()
        os.replace(tmp_path / "moved", out / "checkpoints")


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_writing_metrics_or_config_is_one_line(tmp_path, monkeypatch):
    from distframe import train_loop
    log = MetricsLog(str(tmp_path))
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(ConfigError, match="cannot write .*metrics.jsonl"):
        log.append({"step": 1, "train_loss": 1.0, "val_loss": None, "tokens_per_s": 1.0,
                    "peak_memory_bytes": 1, "wall_s": 1.0})
    with pytest.raises(ConfigError, match="cannot read .*metrics.jsonl"):
        log.keep_until(1)
    (tmp_path / "metrics.jsonl").rmdir()
    monkeypatch.setattr(os, "replace", _no_space)
    with pytest.raises(ConfigError, match=r"--out .*cannot write .*metrics.jsonl \(No space left"):
        log.keep_until(1)
    config = TrainConfig(out=str(tmp_path), resume=True)
    with pytest.raises(ConfigError, match=r"cannot write .*config.json \(No space left on device\)"):
        train_loop.prepare_out(config, {"model": {}}, log)
