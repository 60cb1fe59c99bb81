"""``--strategy pipeline | tensor | hybrid`` end to end on the in-memory engine: each trains the
same curve as DDP (float64, same seed and batches), leaves the same outputs, and a checkpoint
saved under hybrid resumes under DDP and back to the same curve as an uninterrupted run."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

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
}


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
