"""--optimizer async: the server applies the run's learning-rate schedule (warm-up, cosine) by
update, which it used to ignore for a constant --lr; --resume of an async run stays exact; an
explicit --checkpoint-every is refused (async saves once, at the end) and --eval-every warned
about, where both were ignored without a word."""
from __future__ import annotations

import pytest

from tests.train.conftest import TINY, train
from tests.train.test_bad_input import _fails_with

FLOAT64 = ("--dtype", "float64", "--eval-batches", "1", "--warmup-steps", "2")
ASYNC = ("--optimizer", "async", "--round-robin", "--world-size", "2")


def test_one_async_worker_trains_the_single_process_run(tmp_path, corpus_file):
    """One worker, each gradient applied before its next pull: the steps of one process, at the
    same learning rate of each step (warm-up and cosine included)."""
    single = train(tmp_path / "single", corpus_file, *FLOAT64, "--steps", "4", "--world-size", "1")
    served = train(tmp_path / "async", corpus_file, *FLOAT64, "--steps", "4", *ASYNC)
    for a, b in zip(single, served, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-10)
    assert served[-1]["val_loss"] == pytest.approx(single[-1]["val_loss"], abs=1e-10)


def test_async_resume_equals_the_uninterrupted_run(tmp_path, corpus_file):
    full = train(tmp_path / "full", corpus_file, *FLOAT64, "--steps", "4", *ASYNC)
    train(tmp_path / "part", corpus_file, *FLOAT64, "--steps", "2", *ASYNC)
    # (train() passes the tiny settings, --warmup-steps 3 among them: FLOAT64's 2 again)
    resumed = train(tmp_path / "part", corpus_file, *FLOAT64, "--resume", "--steps", "4",
                    "--world-size", "2")
    assert [(m["step"], m["train_loss"]) for m in resumed] == [(m["step"], m["train_loss"]) for m in full]
    assert resumed[-1]["val_loss"] == full[-1]["val_loss"]


def test_intervals_async_does_not_keep(capsys, tmp_path, corpus_file):
    argv = ["train", *TINY, "--data", corpus_file, "--out", str(tmp_path / "run"), "--steps", "2", *ASYNC]
    _fails_with(capsys, [*argv, "--checkpoint-every", "1"], "--checkpoint-every 1", "--optimizer async",
                "at the end")
    train(tmp_path / "run", corpus_file, "--steps", "2", *ASYNC, "--eval-every", "1",
          "--checkpoint-every", "0")
    warned = [line for line in capsys.readouterr().err.splitlines() if "--eval-every 1" in line]
    assert len(warned) == 1 and "--optimizer async" in warned[0]
