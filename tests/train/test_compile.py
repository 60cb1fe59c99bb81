"""``distframe train --compile``: each transformer block compiled in place trains the same run as
eager training (float64, to 1e-10): on process ranks (Gloo, ZeRO-3, whose units gather around
the compiled blocks) and on one in-memory rank, where Dynamo is seen to make graphs. In-memory
ranks of more than one thread are refused (tests/train/test_bad_input.py). ``aot_eager`` and
``eager`` compile without a C compiler; inductor runs on GPUs in tests/train/test_gpu.py."""
from __future__ import annotations

import pytest

from tests.train.conftest import train

# Evaluations and checkpoints at steps 2 and 4: a compiled LM once went wrong two steps after its
# first evaluation pass (tests/attention/test_compile.py).
FLAGS = ("--dtype", "float64", "--steps", "4", "--eval-every", "2", "--checkpoint-every", "2")


def _assert_same_run(compiled: list[dict], eager: list[dict]) -> None:
    assert [m["step"] for m in compiled] == [m["step"] for m in eager] == [1, 2, 3, 4]
    for a, b in zip(eager, compiled):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=0, abs=1e-10)
        assert (b["val_loss"] is None) == (a["val_loss"] is None)
        if a["val_loss"] is not None:
            assert b["val_loss"] == pytest.approx(a["val_loss"], rel=0, abs=1e-10)


@pytest.mark.gloo
def test_compiled_zero3_on_process_ranks_trains_the_eager_run(tmp_path, corpus_file):
    compiled = train(tmp_path / "compiled", corpus_file, *FLAGS, "--strategy", "zero3", "--backend", "gloo",
                     "--world-size", "2", "--compile", "aot_eager")
    eager = train(tmp_path / "eager", corpus_file, *FLAGS, "--strategy", "zero3", "--backend", "inmemory",
                  "--world-size", "2")
    _assert_same_run(compiled, eager)


def test_one_in_memory_rank_trains_compiled(tmp_path, corpus_file):
    from torch._dynamo.utils import counters
    graphs = counters["stats"]["unique_graphs"]
    compiled = train(tmp_path / "compiled", corpus_file, *FLAGS, "--world-size", "1", "--compile", "eager")
    assert counters["stats"]["unique_graphs"] > graphs, "nothing was compiled"
    eager = train(tmp_path / "eager", corpus_file, *FLAGS, "--world-size", "1")
    _assert_same_run(compiled, eager)
