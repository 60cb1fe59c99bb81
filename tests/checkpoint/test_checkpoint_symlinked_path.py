"""Saving over a path that is a symbolic link to a checkpoint (``latest`` -> ``step-1``) replaces
the link with the new checkpoint and leaves the link's target alone; nothing of the old link
stays to be taken for a checkpoint of that name later."""
import os

import torch
from torch import nn

from distframe import checkpoint
from distframe.launch import spawn
from distframe.models import DDPModel
from tests.models.common import SEED_LOCK


def _save(backend, path, step):
    with SEED_LOCK:
        torch.manual_seed(step)
        module = nn.Linear(4, 4).double()
    checkpoint.save(path, DDPModel(module, backend), step=step)


def _step(path):
    def load(backend):
        with SEED_LOCK:
            module = nn.Linear(4, 4).double()
        return checkpoint.load(path, DDPModel(module, backend))["step"]
    return spawn(load, 1, timeout=30)[0]


def test_saving_over_a_symlink_leaves_no_old_link_behind(tmp_path):
    # The moved-aside link (.latest.old-*) was never removed (rmtree refuses symlinks, silently),
    # and once 'latest' was removed, load(root / 'latest') loaded step-1 through it.
    spawn(lambda b: _save(b, tmp_path / "step-1", 1), 2, timeout=30)
    os.symlink("step-1", tmp_path / "latest")
    spawn(lambda b: _save(b, tmp_path / "latest", 2), 2, timeout=30)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-1"]
    assert not (tmp_path / "latest").is_symlink()
    assert (_step(tmp_path / "latest"), _step(tmp_path / "step-1")) == (2, 1)
    spawn(lambda b: _save(b, tmp_path / "latest", 3), 2, timeout=30)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-1"]
    for entry in (tmp_path / "latest").iterdir():
        entry.unlink()
    (tmp_path / "latest").rmdir()
    assert sorted(checkpoint.complete_checkpoints(tmp_path)) == ["step-1"]


def test_saving_over_a_link_to_nothing_replaces_it(tmp_path):
    # The link counted as absent, and renaming the new checkpoint onto it failed (ENOTDIR).
    os.symlink("step-0", tmp_path / "latest")
    spawn(lambda b: _save(b, tmp_path / "latest", 2), 2, timeout=30)
    assert sorted(os.listdir(tmp_path)) == ["latest"] and not (tmp_path / "latest").is_symlink()
    assert _step(tmp_path / "latest") == 2
