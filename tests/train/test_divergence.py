"""A run whose parameters stop being finite stops before it checkpoints them.

With --lr 1e6 the training loss at step 2 was still finite (2.3e11, computed before that step's
update) while the parameters were not (validation loss NaN): step-2 was saved full of NaN, the
next step failed saying to lower --lr, and --resume with a lower --lr then loaded the NaN
checkpoint and failed again at once. With --steps 2 the run even ended with status 0."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from distframe.cli import main
from tests.train.conftest import TINY


@pytest.mark.parametrize("lr, steps, what", [
    ("1e6", "2", "validation loss (nan) is not finite at step 1"),
    ("1e38", "1", "validation loss (nan) is not finite at step 1"),  # step-1 was saved, exit 0
    ("1e38", "3", "step 1's update overflowed (value cannot be converted")])  # a traceback
def test_no_checkpoint_holds_a_diverged_state(tmp_path, corpus_file, capsys, lr, steps, what):
    out = tmp_path / "run"
    argv = ["train", *TINY, "--data", corpus_file, "--out", str(out), "--world-size", "2",
            "--lr", lr, "--warmup-steps", "0", "--checkpoint-every", "1", "--eval-every", "1"]
    assert main([*argv, "--steps", steps]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("distframe")]
    assert len(err) == 1 and what in err[0] and f"lower --lr (now {float(lr):g})" in err[0], err
    assert "--dtype float32" not in err[0]  # it is float32 already
    saved = sorted((out / "checkpoints").glob("step-*"))
    shards = [f for step in saved for f in step.glob("shard-*")]
    assert not saved, saved
    for shard in shards:
        for name, tensor in load_file(str(shard)).items():
            assert not tensor.is_floating_point() or torch.isfinite(tensor).all(), (shard, name)


def test_a_step_that_leaves_a_parameter_nan_is_not_saved(tmp_path, corpus_file, capsys, monkeypatch):
    # The loss is computed before the step's update, so the update itself is checked before a save.
    from distframe import train_loop
    step = train_loop.Job._train_step

    def poisoned(job, number):
        result = step(job, number)
        with torch.no_grad():
            job.model.local_parameter_shard()[0].view(-1)[0] = float("nan")
        return result

    monkeypatch.setattr(train_loop.Job, "_train_step", poisoned)
    out = tmp_path / "run"
    assert main(["train", *TINY, "--data", corpus_file, "--out", str(out), "--world-size", "2",
                 "--steps", "3", "--checkpoint-every", "1", "--eval-every", "100"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("distframe")]
    assert len(err) == 1 and "parameters are not finite after step 1, so it is not saved" in err[0], err
    assert not list((out / "checkpoints").glob("step-*"))
