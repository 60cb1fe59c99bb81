"""``distframe train --activation-checkpointing``: the same run (losses bit for bit, dropout on)
under every kind of strategy. The main job's dropout draws from generators of each rank's own and
tensor parallelism's from replicated and split ones, which the recomputation must restore."""
from __future__ import annotations

import pytest

from tests.train.conftest import train

FLOAT64 = ("--dtype", "float64", "--steps", "3", "--eval-every", "0", "--dropout", "0.1")
LAYOUTS = [("ddp", "--world-size", "2"), ("zero3", "--world-size", "2"), ("fsdp", "--world-size", "2"),
           ("tensor", "--world-size", "2", "--tp", "2"),
           ("pipeline", "--world-size", "2", "--pp", "2", "--micro-batches", "2")]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_checkpointed_blocks_train_the_same_run(tmp_path, corpus_file, layout):
    strategy, *flags = layout
    plain = train(tmp_path / "plain", corpus_file, *FLOAT64, "--strategy", strategy, *flags)
    recomputed = train(tmp_path / "recomputed", corpus_file, *FLOAT64, "--strategy", strategy, *flags,
                       "--activation-checkpointing")
    assert [r["train_loss"] for r in recomputed] == [r["train_loss"] for r in plain]
