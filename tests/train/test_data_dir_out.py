"""--data DIR: the walk leaves the run's own --out out (with --data . and the default --out
inside it, the run trained on its metrics and checkpoints, and --resume read other data), and a
tiny file hashed into the validation split falls back to a tail split instead of stopping with
"its validation split holds 5 tokens" when the data is plenty."""
from __future__ import annotations

import json
import shutil

import numpy as np

from distframe.cli import main
from distframe.data import check_windows, in_validation_split, load_corpus
from tests.train.conftest import TINY, train

FLAGS = ("--world-size", "1", "--eval-batches", "1")


def test_the_runs_out_is_not_its_data(tmp_path, corpus_file, capsys):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(corpus_file, data / "a.txt")
    before = load_corpus(str(data)).digest
    out = data / "runs" / "train"
    train(out, str(data), "--steps", "1", *FLAGS)
    assert load_corpus(str(data), exclude=str(out)).digest == before
    assert json.loads((out / "config.json").read_text())["data_sha256"] == before
    capsys.readouterr()
    train(out, str(data), "--steps", "2", "--resume", *FLAGS)
    assert "other data" not in capsys.readouterr().err  # it read what the first part read


def _validation_name() -> str:
    return next(f"v{i}.txt" for i in range(1000) if in_validation_split(f"v{i}.txt"))


def test_a_tiny_file_hashed_into_validation(tmp_path, corpus_file, capsys):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(corpus_file, data / "big.txt")
    (data / _validation_name()).write_bytes(b"tiny\n")
    corpus = load_corpus(str(data), window=33)
    check_windows(corpus, 32)
    total = len(corpus.train) + len(corpus.validation)
    assert len(corpus.validation) == total * 5 // 100  # the tail split
    split = load_corpus(str(data))  # no window to fit: still the split by path
    assert np.asarray(split.validation).tobytes() == b"tiny\n"
    assert main(["train", *TINY, "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "1",
                 *FLAGS]) == 0, capsys.readouterr().err
