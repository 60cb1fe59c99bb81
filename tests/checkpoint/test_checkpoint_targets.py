"""What ``save`` may replace: an absent path, an empty directory or an earlier checkpoint; a file
or a directory of other things is refused on every rank before anything is written."""
import pytest
import torch

from distframe import checkpoint
from distframe.errors import ConfigError
from distframe.launch import spawn
from tests.models.common import STRATEGIES, build_model, global_batches, loss_fn, rank_slice


def _save(backend, path):
    model = STRATEGIES["zero2"][0](build_model(), backend)
    opt = STRATEGIES["zero2"][1](model, torch.optim.Adam, lr=1e-2)
    model.train_step(rank_slice(global_batches(1, 12)[0], backend.rank, backend.world_size), loss_fn, opt)
    try:
        checkpoint.save(path, model, opt, step=1)
    except Exception as exc:  # noqa: BLE001 - returned to the test to inspect
        return type(exc), str(exc)
    return model.gather_full_parameters()


def _listing(directory):
    return sorted((p.relative_to(directory).as_posix(), p.is_file() and p.read_bytes())
                  for p in directory.rglob("*"))


@pytest.mark.parametrize("what", ["file", "directory"])
def test_saving_over_something_that_is_not_a_checkpoint_is_refused_and_keeps_it(tmp_path, what):
    # save moved whatever was at the path aside and deleted it (a directory) or left it hidden
    # as .<name>.old-* (a file), so a mistyped path silently destroyed the user's data.
    target = tmp_path / "out"
    if what == "file":
        target.write_bytes(b"not a checkpoint")
    else:
        (target / "sub").mkdir(parents=True)
        (target / "notes.txt").write_bytes(b"keep me")
    before = _listing(tmp_path)
    for kind, message in spawn(lambda b: _save(b, target), 2, timeout=30):
        assert kind is ConfigError, message
        assert str(target) in message and "choose another path" in message
    assert _listing(tmp_path) == before


def test_saving_into_an_empty_directory_or_over_a_checkpoint_works(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    spawn(lambda b: _save(b, target), 2, timeout=30)
    saved = spawn(lambda b: _save(b, target), 2, timeout=30)[0]  # over the first one
    for name, value in checkpoint.consolidate(target).items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_saving_as_the_current_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for kind, message in spawn(lambda b: _save(b, "."), 2, timeout=30):
        assert kind is ConfigError and "name the directory to create" in message, message
    assert list(tmp_path.iterdir()) == []
