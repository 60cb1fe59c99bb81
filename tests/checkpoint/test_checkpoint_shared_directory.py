"""Every rank of a save must write into the one directory rank 0 renames into place: a save whose
ranks wrote elsewhere (node-local disks, a name that differs between ranks) is refused on every
rank before anything is committed, leaving the previous checkpoint loadable and no temporary
directory behind; different spellings of one directory still save."""
import os

import safetensors.torch
import torch
from torch import nn

from distframe import checkpoint
from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import ZeRO3Model
from tests.models.common import SEED_LOCK


def _model(backend, seed=0):
    with SEED_LOCK:
        torch.manual_seed(seed)
        module = nn.Linear(4, 4).double()
    return ZeRO3Model(module, backend)


def _outcome(action):
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - returned to the test to inspect
        return type(exc), str(exc)
    return None


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _check_refused(outcomes, root, before):
    for outcome in outcomes:
        assert outcome is not None, "the save returned normally"
        kind, message = outcome
        assert kind is ConfigError, message
        assert "ranks [1] wrote their shard where rank 0 cannot see it" in message, message
        assert "same directory on a shared file system" in message, message
    assert _listing(root) == before  # the old checkpoint as it was; no temporary directory


def test_ranks_saving_to_their_own_disks_are_refused(tmp_path):
    # Each rank's path on its own "node": save returned normally, replaced node0's checkpoint by
    # one without rank 1's shard, and left rank 1's temporary directory behind.
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    saved = spawn(lambda b: (checkpoint.save(nodes[0] / "ckpt", m := _model(b), step=1),
                             m.gather_full_parameters())[1], 2, timeout=30)[0]
    before = _listing(tmp_path)
    outcomes = spawn(lambda b: _outcome(lambda: checkpoint.save(nodes[b.rank] / "ckpt", _model(b, 1),
                                                                step=2)), 2, timeout=30)
    _check_refused(outcomes, tmp_path, before)
    for name, value in checkpoint.consolidate(nodes[0] / "ckpt").items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0)


def test_ranks_saving_under_different_names_are_refused(tmp_path):
    outcomes = spawn(lambda b: _outcome(lambda: checkpoint.save(tmp_path / f"ckpt-{b.rank}", _model(b),
                                                                step=1)), 2, timeout=30)
    _check_refused(outcomes, tmp_path, [])


def test_one_directory_spelled_differently_by_each_rank_saves(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = [tmp_path / "ckpt", "ckpt"]  # absolute on rank 0, relative on rank 1
    saved = spawn(lambda b: (checkpoint.save(paths[b.rank], m := _model(b), step=1),
                             m.gather_full_parameters())[1], 2, timeout=30)[0]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    for name, value in checkpoint.consolidate(tmp_path / "ckpt").items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0)


def test_a_failed_write_leaves_no_temporary_directory_on_any_rank_s_disk(tmp_path, monkeypatch):
    # Rank 0 removed its own temporary directory only: rank 1's stayed on its disk.
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    real = safetensors.torch.save_file

    def save_file(tensors, filename, *args, **kwargs):
        real(tensors, filename, *args, **kwargs)
        if "shard-00001" in str(filename):
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    outcomes = spawn(lambda b: _outcome(lambda: checkpoint.save(nodes[b.rank] / "ckpt", _model(b), step=1)),
                     2, timeout=30)
    monkeypatch.undo()
    for kind, message in outcomes:
        assert kind is ConfigError and "No space left on device" in message, message
    assert _listing(tmp_path) == ["node0", "node1"]
