"""``--dropout`` where a rank's generators meet a change of layout (float64, in-memory engine):
an elastic run resumed at the same world size continues its masks exactly; a membership change
inside an elastic run starts new streams seeded from the step (never the ones already used) and
says so; a pipeline resumed with another number of model chunks per rank draws new masks and
says so."""
from __future__ import annotations

from pathlib import Path

import torch

from distframe.checkpoint.format import open_reader, read_metadata
from distframe.train_config import TrainConfig
from distframe.train_rng import layout
from tests.train.conftest import interrupted_copy, step_losses, train

STEPS = 6
DROPOUT = ("--dtype", "float64", "--steps", str(STEPS), "--eval-every", "3",
           "--checkpoint-every", "3", "--dropout", "0.1")
ELASTIC = ("--optimizer", "elastic", "--world-size", "2")
NEW_MASKS = "dropout masks from step 4 on are new"
INTERLEAVED = ("--strategy", "pipeline", "--world-size", "2", "--micro-batches", "2",
               "--schedule", "interleaved_1f1b", "--virtual-stages", "2")


def _dropout_states(run: Path, step: int) -> dict[str, torch.Tensor]:
    """Every rank's dropout generator states in checkpoint ``step-<step>`` of ``run``, keyed
    ``rank<r>/<entry>`` (the layout left out, so checkpoints of two layouts compare)."""
    path = run / "checkpoints" / f"step-{step}"
    meta = read_metadata(path)
    states = open_reader(path, meta).wholes("rank_state", "")
    return {name.split("/", 1)[1]: value for name, value in states.items() if "/dropout." in name}


def test_elastic_resume_at_the_same_world_continues_the_masks(tmp_path, corpus_file, capsys):
    full = train(tmp_path / "full", corpus_file, *ELASTIC, *DROPOUT)
    copy = interrupted_copy(tmp_path / "full", tmp_path / "resumed", keep_step=3)
    capsys.readouterr()
    resumed = train(copy, corpus_file, "--resume", "--world-size", "2")
    assert "dropout masks" not in capsys.readouterr().err
    assert step_losses(resumed) == step_losses(full)  # bit for bit


def test_elastic_membership_change_draws_new_masks_and_says_so(tmp_path, corpus_file, capsys):
    capsys.readouterr()
    changed = train(tmp_path / "changed", corpus_file, *ELASTIC, *DROPOUT, "--elastic-schedule", "3:2")
    err = capsys.readouterr().err
    assert NEW_MASKS in err and "the workers changed" in err
    # The second group's streams are not the first group's again: after as many draws as the
    # first group made by step 3, its generators are elsewhere.
    first, second = _dropout_states(tmp_path / "changed", 3), _dropout_states(tmp_path / "changed", 6)
    assert sorted(first) == sorted(second) and first
    assert all(not torch.equal(first[k], second[k]) for k in first if not k.endswith("seeds"))
    unchanged = train(tmp_path / "unchanged", corpus_file, *ELASTIC, *DROPOUT)
    assert step_losses(changed)[:3] == step_losses(unchanged)[:3]
    assert all(a[1] != b[1] for a, b in zip(step_losses(changed)[3:], step_losses(unchanged)[3:]))


def test_elastic_resume_at_a_scheduled_change_equals_the_uninterrupted_run(tmp_path, corpus_file):
    """The checkpoint of step 3 is the world-2 group's, the resumed run starts with the world
    the schedule reached (1): new streams seeded from the step, as the uninterrupted run's."""
    flags = (*ELASTIC, *DROPOUT, "--elastic-schedule", "3:1")
    full = train(tmp_path / "full", corpus_file, *flags)
    copy = interrupted_copy(tmp_path / "full", tmp_path / "resumed", keep_step=3)
    assert step_losses(train(copy, corpus_file, "--resume")) == step_losses(full)


def test_layout_counts_the_model_chunks_of_a_rank():
    config = TrainConfig(strategy="pipeline", micro_batches=2, schedule="interleaved_1f1b",
                         virtual_stages=2)
    assert layout(config, 2)["virtual_stages"] == 2
    # One chunk per rank leaves the layout as checkpoints written before it counted chunks
    # recorded it, so they still continue their masks exactly.
    plain = TrainConfig(strategy="pipeline", micro_batches=2, schedule="1f1b")
    assert "virtual_stages" not in layout(plain, 2)


def test_pipeline_resumed_with_other_chunks_draws_new_masks(tmp_path, corpus_file, capsys):
    full = train(tmp_path / "full", corpus_file, *INTERLEAVED, *DROPOUT)
    same = interrupted_copy(tmp_path / "full", tmp_path / "same", keep_step=3)
    capsys.readouterr()
    assert step_losses(train(same, corpus_file, "--resume", "--world-size", "2")) == step_losses(full)
    assert "dropout masks" not in capsys.readouterr().err
    other = interrupted_copy(tmp_path / "full", tmp_path / "other", keep_step=3)
    resumed = train(other, corpus_file, "--resume", "--world-size", "2", "--schedule", "1f1b")
    err = capsys.readouterr().err
    assert NEW_MASKS in err and "virtual_stages=2" in err
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))


def test_elastic_rollback_after_a_failure_draws_new_masks(tmp_path, corpus_file, capsys):
    capsys.readouterr()
    train(tmp_path / "failed", corpus_file, *ELASTIC, *DROPOUT, "--fail-at", "4", "--commit-every", "2")
    err = capsys.readouterr().err
    assert "elastic: world 1 (workers [0]) from step 4" in err
    assert "dropout masks from step 5 on are new" in err
