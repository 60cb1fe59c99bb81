"""``--strategy pipeline | tensor | hybrid`` end to end on the in-memory engine: each trains the
same curve as DDP (float64, same seed and batches), leaves the same outputs, and a checkpoint
saved under hybrid resumes under DDP and back to the same curve as an uninterrupted run; the
interleaved 1F1B schedule trains and resumes as plain 1F1B does."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from distframe.checkpoint import consolidate
from distframe.launch import spawn
from distframe.train_config import TrainConfig
from distframe.train_strategies import STRATEGIES
from tests.train.conftest import train

STEPS = 6
RUNS = {
    "ddp": ("--strategy", "ddp", "--world-size", "2"),
    "pipeline": ("--strategy", "pipeline", "--world-size", "2", "--micro-batches", "2"),
    "pipeline-gpipe": ("--strategy", "pipeline", "--world-size", "2", "--micro-batches", "4",
                       "--schedule", "gpipe"),
    "tensor": ("--strategy", "tensor", "--world-size", "2"),
    "hybrid": ("--strategy", "hybrid", "--world-size", "4", "--dp", "2", "--tp", "2"),
    "hybrid-pp": ("--strategy", "hybrid", "--world-size", "4", "--dp", "2", "--pp", "2",
                  "--micro-batches", "2"),
    "hybrid-cp": ("--strategy", "hybrid", "--world-size", "4", "--dp", "2", "--cp", "2"),
    "hybrid-tp-cp": ("--strategy", "hybrid", "--world-size", "4", "--tp", "2", "--cp", "2"),
    "pipeline-interleaved": ("--strategy", "pipeline", "--world-size", "2", "--micro-batches", "2",
                             "--schedule", "interleaved_1f1b", "--virtual-stages", "2"),
    "hybrid-pp-interleaved": ("--strategy", "hybrid", "--world-size", "4", "--dp", "2", "--pp", "2",
                              "--micro-batches", "2", "--schedule", "interleaved_1f1b",
                              "--virtual-stages", "2"),
}
# Each interleaved run and the same run under plain 1F1B.
INTERLEAVED = {"pipeline-interleaved": "pipeline", "hybrid-pp-interleaved": "hybrid-pp"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_file):
    """``runs[name]``: (OUT, metrics) of RUNS[name] trained STEPS steps in float64, with
    validation and checkpoints every 3 steps; each run happens once, when first asked for."""
    root, done = tmp_path_factory.mktemp("model_parallel"), {}

    def get(name: str) -> tuple[Path, list[dict]]:
        if name not in done:
            done[name] = (root / name, train(root / name, corpus_file, *RUNS[name], "--dtype",
                                             "float64", "--steps", str(STEPS), "--eval-every", "3",
                                             "--checkpoint-every", "3"))
        return done[name]
    return get


def _same_curve(expected: list[dict], got: list[dict]) -> None:
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for a, b in zip(expected, got):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-8)
        if a["val_loss"] is not None:
            assert b["val_loss"] == pytest.approx(a["val_loss"], abs=1e-8)


@pytest.mark.parametrize("name", [n for n in RUNS if n != "ddp"])
def test_same_curve_as_ddp(runs, name):
    path, metrics = runs(name)
    _same_curve(runs("ddp")[1], metrics)
    assert metrics[0]["tokens_per_s"] > 0 and metrics[-1]["val_loss"] is not None
    assert sorted(p.name for p in (path / "checkpoints").iterdir()) == ["step-3", "step-6"]
    assert json.loads((path / "config.json").read_text())["train"]["strategy"] == RUNS[name][1]


def _interrupted_copy(run: Path, destination: Path) -> Path:
    """OUT as if the run had stopped right after its step-3 checkpoint."""
    shutil.copytree(run, destination)
    shutil.rmtree(destination / "checkpoints" / "step-6")
    return destination


@pytest.mark.parametrize(("saved", "resume_as"), [
    ("hybrid", ("--strategy", "ddp", "--world-size", "2")),
    ("hybrid-pp", ("--strategy", "ddp", "--world-size", "2")),  # a tied weight on two stages
    ("ddp", ("--strategy", "hybrid", "--world-size", "4", "--dp", "2", "--tp", "2")),
])
def test_resume_across_strategies(runs, tmp_path, corpus_file, saved, resume_as):
    copy = _interrupted_copy(runs(saved)[0], tmp_path / "resumed")
    resumed = train(copy, corpus_file, "--resume", *resume_as)
    _same_curve(runs("ddp")[1], resumed)
    config = json.loads((copy / "config.json").read_text())["train"]
    assert config["strategy"] == resume_as[1]
    if resume_as[1] == "ddp":  # the hybrid run's degrees do not carry over to DDP
        assert (config["dp"], config["tp"], config["pp"]) == (None, None, None)


def _same_run(expected: tuple[Path, list[dict]], got: tuple[Path, list[dict]]) -> None:
    """The same losses (relative 1e-12) and final parameters (relative 1e-12, absolute 1e-10, the
    parity contract): float64 runs that differ only in the order of the sums over micro-batches
    and ranks. The key projection's bias has no true gradient (softmax ignores a shift shared by
    every key), so it holds only rounding noise, which AdamW steps by up to lr * noise / eps: about
    1e-12 here, and 1.1e-12 apart between the runs on one machine (atol 1e-12 failed there)."""
    assert [m["step"] for m in got[1]] == [m["step"] for m in expected[1]]
    for a, b in zip(expected[1], got[1]):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-12, abs=0)
        if a["val_loss"] is None:
            assert b["val_loss"] is None
        else:
            assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-12, abs=0)
    want, have = (consolidate(out / "checkpoints" / f"step-{STEPS}") for out in (expected[0], got[0]))
    assert have.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(have[name], tensor, rtol=1e-12, atol=1e-10, msg=name)


@pytest.mark.parametrize("name", INTERLEAVED)
def test_interleaved_trains_as_plain_1f1b(runs, name):
    _same_run(runs(INTERLEAVED[name]), runs(name))
    assert json.loads((runs(name)[0] / "config.json").read_text())["train"]["virtual_stages"] == 2


@pytest.mark.parametrize(("saved", "resume_as", "settings"), [
    ("pipeline-interleaved", (), ("interleaved_1f1b", 2)),
    ("pipeline-interleaved", ("--schedule", "1f1b"), ("1f1b", 1)),
    ("pipeline", ("--schedule", "interleaved_1f1b", "--virtual-stages", "2"), ("interleaved_1f1b", 2)),
    ("hybrid-pp-interleaved", ("--strategy", "ddp", "--world-size", "2"), ("1f1b", 1)),
])
def test_interleaved_checkpoints_resume(runs, tmp_path, corpus_file, saved, resume_as, settings):
    copy = _interrupted_copy(runs(saved)[0], tmp_path / "resumed")
    resumed = train(copy, corpus_file, "--resume", *resume_as)
    _same_run(runs("pipeline"), (copy, resumed))
    config = json.loads((copy / "config.json").read_text())["train"]
    assert (config["schedule"], config["virtual_stages"]) == settings


@pytest.mark.parametrize(("strategy", "world", "dp"), [("pipeline", 2, None), ("hybrid", 4, 2)])
def test_the_trainer_wraps_the_model_in_virtual_stages(strategy, world, dp):
    # Equal curves alone would not show that the chunks exist: plain 1F1B gives the same.
    from attention.model import DilatedTransformerLM
    config = TrainConfig(strategy=strategy, world_size=world, dp=dp, pp=2, preset="tiny",
                         micro_batches=2, schedule="interleaved_1f1b", virtual_stages=2)

    def run(b):
        lm = DilatedTransformerLM(config.model_config(vocab_size=256)).double()
        model = STRATEGIES[strategy].wrap(lm, b, config)
        return len(model.runner.chunks), {(a.kind, a.chunk) for a in model.runner.actions}

    for chunks, actions in spawn(run, world):
        assert chunks == 2 and actions == {(k, c) for k in "FB" for c in (0, 1)}
