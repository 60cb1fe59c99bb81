"""``--grad-accum-steps`` and ``--max-grad-norm`` in ``distframe train``: accumulation gives the
run it accumulates (each rank's share in pieces, one synchronisation a step), and clipping by
the whole model's norm gives the same run under every strategy and world size."""
from __future__ import annotations

import pytest

from distframe.cli import main
from tests.train.conftest import TINY, train

FLOAT64 = ("--dtype", "float64", "--steps", "4", "--eval-every", "0")
LAYOUTS = [("ddp", "--world-size", "2"), ("zero3", "--world-size", "2"), ("fsdp", "--world-size", "1"),
           ("pipeline", "--world-size", "2", "--pp", "2", "--micro-batches", "2")]


def losses(records):
    return [r["train_loss"] for r in records]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_accumulation_trains_the_same_run(tmp_path, corpus_file, layout):
    strategy, *flags = layout
    whole = train(tmp_path / "whole", corpus_file, *FLOAT64, "--strategy", strategy, *flags)
    pieces = train(tmp_path / "pieces", corpus_file, *FLOAT64, "--strategy", strategy, *flags,
                   "--grad-accum-steps", "2")
    assert losses(pieces) == pytest.approx(losses(whole), rel=1e-10)


def test_clipping_is_by_the_whole_model_under_every_layout(tmp_path, corpus_file):
    runs = [losses(train(tmp_path / layout[0], corpus_file, *FLOAT64, "--max-grad-norm", "0.05",
                         "--strategy", *layout)) for layout in LAYOUTS]
    unclipped = losses(train(tmp_path / "unclipped", corpus_file, *FLOAT64))
    for run in runs[1:]:
        assert run == pytest.approx(runs[0], rel=1e-9)
    assert runs[0][-1] != pytest.approx(unclipped[-1], rel=1e-6)   # the clip did act


@pytest.mark.parametrize("flags,message", [
    (("--grad-accum-steps", "3"), "--grad-accum-steps 3 does not divide the 4 sequences"),
    (("--grad-accum-steps", "0"), "--grad-accum-steps 0: use an integer >= 1"),
    (("--max-grad-norm", "-1"), "--max-grad-norm -1.0: use a positive number"),
    (("--optimizer", "async", "--grad-accum-steps", "2"), "--optimizer async"),
])
def test_bad_settings_are_one_line_errors(tmp_path, corpus_file, capsys, flags, message):
    status = main(["train", *TINY, "--data", corpus_file, "--out", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert status == 2 and message in err and "Traceback" not in err
