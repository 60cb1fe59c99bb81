"""``--dropout`` end to end (float64, in-memory engine unless named): a run resumed from a
checkpoint draws the masks the uninterrupted run drew, under every strategy (same losses bit for
bit, same parameters); runs with one seed are identical, with two seeds different; a resume at
another layout, or from a checkpoint without generator states, draws new masks and says so."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distframe.checkpoint import consolidate
from distframe.train_settings import resolve_config
from tests.train.conftest import interrupted_copy, step_losses, train

STEPS = 6
DROPOUT = ("--dtype", "float64", "--steps", str(STEPS), "--eval-every", "3",
           "--checkpoint-every", "3", "--dropout", "0.1")
LAYOUTS = {
    "ddp": ("--strategy", "ddp", "--world-size", "2"),
    "zero1": ("--strategy", "zero1", "--world-size", "2"),
    "zero2": ("--strategy", "zero2", "--world-size", "2"),
    "zero3": ("--strategy", "zero3", "--world-size", "2"),
    "fsdp": ("--strategy", "fsdp", "--world-size", "2"),
    "pipeline": ("--strategy", "pipeline", "--world-size", "2", "--micro-batches", "2"),
    "tensor": ("--strategy", "tensor", "--world-size", "2"),
    "hybrid-tp": ("--strategy", "hybrid", "--world-size", "4", "--dp", "2", "--tp", "2"),
    "hybrid-pp": ("--strategy", "hybrid", "--world-size", "4", "--dp", "2", "--pp", "2",
                  "--micro-batches", "2"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_file):
    """``runs(name, *flags)``: (OUT, metrics) of LAYOUTS[name] with ``flags``, STEPS steps with
    dropout 0.1 and checkpoints every 3 steps; each run happens once, when first asked for."""
    root, done = tmp_path_factory.mktemp("dropout"), {}

    def get(name: str, *flags: str) -> tuple[Path, list[dict]]:
        key = (name, *flags)
        if key not in done:
            out = root / f"{name}{len(done)}"
            done[key] = (out, train(out, corpus_file, *LAYOUTS[name], *DROPOUT, *flags))
        return done[key]
    return get


def _same_parameters(a: Path, b: Path) -> None:
    first = consolidate(a / "checkpoints" / f"step-{STEPS}")
    second = consolidate(b / "checkpoints" / f"step-{STEPS}")
    assert sorted(first) == sorted(second)
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize("name", LAYOUTS)
def test_resume_equals_uninterrupted(runs, tmp_path, corpus_file, name):
    run, full = runs(name)
    copy = interrupted_copy(run, tmp_path / "resumed", keep_step=3)
    world = LAYOUTS[name][LAYOUTS[name].index("--world-size") + 1]  # how it was launched
    resumed = train(copy, corpus_file, "--resume", "--world-size", world)
    assert step_losses(resumed) == step_losses(full)  # bit for bit
    _same_parameters(run, copy)


@pytest.mark.parametrize("name", ["ddp", "pipeline", "hybrid-tp"])
def test_same_seed_same_run_other_seed_other_run(runs, tmp_path, corpus_file, name):
    _, first = runs(name)
    again = train(tmp_path / "again", corpus_file, *LAYOUTS[name], *DROPOUT)
    assert step_losses(again) == step_losses(first)
    _, other_seed = runs(name, "--seed", "1")
    assert all(a[1] != b[1] for a, b in zip(step_losses(first), step_losses(other_seed)))


def test_dropout_changes_training(runs):
    _, with_dropout = runs("ddp")
    _, without = runs("ddp", "--dropout", "0")
    # Step 1's loss is the initial model's forward, dropout on: it already differs.
    assert all(a[1] != b[1] for a, b in zip(step_losses(with_dropout), step_losses(without)))


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "fsdp"])
def test_data_parallel_strategies_draw_the_same_masks(runs, name):
    """Each rank's stream depends on its rank and --seed alone: every data-parallel strategy
    trains DDP's curve with dropout too."""
    _, ddp = runs("ddp")
    _, other = runs(name)
    for a, b in zip(step_losses(ddp), step_losses(other)):
        assert b[1] == pytest.approx(a[1], abs=1e-8)


def test_config_json_records_dropout_and_resume_takes_it(runs):
    run, _ = runs("ddp")
    saved = json.loads((run / "config.json").read_text())
    assert saved["train"]["dropout"] == 0.1 and saved["model"]["dropout"] == 0.1
    assert resolve_config({"out": str(run), "resume": True}).dropout == 0.1
    assert resolve_config({"out": str(run), "resume": True, "dropout": 0.2}).dropout == 0.2


@pytest.mark.parametrize(("saved", "flags"), [
    ("ddp", ("--strategy", "fsdp", "--world-size", "1")),
    ("hybrid-tp", ("--strategy", "tensor", "--world-size", "2")),
    ("pipeline", ("--strategy", "ddp", "--world-size", "2")),
])
def test_resume_at_another_layout_draws_new_seeded_masks(runs, tmp_path, corpus_file, capsys,
                                                         saved, flags):
    run, _ = runs(saved)
    results = []
    for attempt in ("a", "b"):
        copy = interrupted_copy(run, tmp_path / attempt, keep_step=3)
        capsys.readouterr()
        results.append(step_losses(train(copy, corpus_file, "--resume", *flags)))
        assert "dropout masks from step 4 on are new" in capsys.readouterr().err
    assert [r[0] for r in results[0]] == list(range(1, STEPS + 1))
    assert results[0] == results[1]  # new masks, but seeded: the same on every try


def test_resume_from_a_checkpoint_without_generator_states(runs, tmp_path, corpus_file, capsys):
    run, full = runs("ddp")
    copy = interrupted_copy(run, tmp_path / "old", keep_step=3)
    meta_path = copy / "checkpoints" / "step-3" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    del meta["rank_state"]  # as distframe wrote it before it kept generator states,
    del meta["metadata_sha256"]  # and before metadata checksums (format version 1)
    meta["format_version"] = 1
    meta_path.write_text(json.dumps(meta))
    capsys.readouterr()
    resumed = train(copy, corpus_file, "--resume")
    assert "holds no generator states" in capsys.readouterr().err
    assert step_losses(resumed)[:3] == step_losses(full)[:3] and len(resumed) == STEPS


@pytest.mark.gloo
def test_gloo_resume_equals_uninterrupted(tmp_path, corpus_file):
    flags = ("--backend", "gloo", "--world-size", "2", *DROPOUT)
    full = train(tmp_path / "full", corpus_file, *flags)
    copy = interrupted_copy(tmp_path / "full", tmp_path / "resumed", keep_step=3)
    resumed = train(copy, corpus_file, "--resume", "--backend", "gloo", "--world-size", "2")
    assert step_losses(resumed) == step_losses(full)
    _same_parameters(tmp_path / "full", copy)
