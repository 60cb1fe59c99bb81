"""--resume takes the run's settings from OUT/config.json or, where that is missing (a checkpoint
copied into a new OUT), from the latest checkpoint's saved run info: it used to train on with
the default settings, silently. --data is saved as an absolute path, so --resume from another
directory reads the same data; a saved path that is not there says to pass --data."""
from __future__ import annotations

import json
import shutil

from distframe.cli import main
from tests.train.conftest import TINY, read_metrics, train
from tests.train.test_bad_input import _fails_with

FLAGS = ("--steps", "4", "--checkpoint-every", "2", "--lr", "0.02", "--warmup-steps", "2",
         "--world-size", "1", "--eval-batches", "1")


def test_a_copied_checkpoint_resumes_with_its_runs_settings(tmp_path, corpus_file, capsys):
    run, copy = tmp_path / "A", tmp_path / "B"
    full = train(run, corpus_file, *FLAGS)
    (copy / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / "step-2", copy / "checkpoints" / "step-2")
    capsys.readouterr()
    # neither the model nor the data nor the schedule given: all from the checkpoint
    assert main(["train", "--resume", "--out", str(copy), "--steps", "4", "--world-size", "1"]) == 0
    err = capsys.readouterr().err
    assert "config.json is missing" in err and "step-2" in err
    resumed = read_metrics(copy)
    assert [(m["step"], m["train_loss"]) for m in resumed] == \
        [(m["step"], m["train_loss"]) for m in full[2:]]
    assert json.loads((copy / "config.json").read_text())["train"]["lr"] == 0.02


def test_a_relative_data_path_resumes_from_another_directory(tmp_path, corpus_file, monkeypatch, capsys):
    shutil.copy(corpus_file, tmp_path / "data.txt")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    train("run", "data.txt", *FLAGS)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["train"]["data"] == str(tmp_path / "data.txt")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-4")
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["train", "--resume", "--out", "../run", "--steps", "4", "--world-size", "1"]) == 0
    # a run saved before paths were absolute: the line says where the path came from
    config["train"]["data"] = "data.txt"
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    _fails_with(capsys, ["train", *TINY, "--resume", "--out", "../run", "--steps", "5"],
                "--data data.txt", "config.json", "pass --data")
