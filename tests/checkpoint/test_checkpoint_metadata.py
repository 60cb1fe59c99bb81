"""metadata.json edited by hand or damaged: load and consolidate raise a CheckpointError naming
the file and what is wrong, never a bare KeyError from deep inside the reader, and never read an
edit that still parses (a shape, a step) as if it had been saved."""
import json
import shutil

import numpy as np
import pytest
import torch

from distframe import checkpoint
from distframe.checkpoint import CheckpointError
from distframe.errors import ConfigError
from distframe.launch import spawn
from tests.models.common import STRATEGIES, build_model, global_batches, loss_fn, rank_slice


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "ckpt"

    def save(backend):
        model = STRATEGIES["zero2"][0](build_model(), backend)
        opt = STRATEGIES["zero2"][1](model, torch.optim.Adam, lr=1e-2)
        model.train_step(rank_slice(global_batches(1, 12)[0], backend.rank, backend.world_size), loss_fn, opt)
        checkpoint.save(path, model, opt, step=1)
    spawn(save, 2, timeout=30)
    return path


def _edited(saved, tmp_path, edit, reseal=True):
    """A copy of ``saved`` whose metadata ``edit`` changed; ``reseal``: with its checksum made to
    match again (what a writer with a bug would leave), to reach the checks behind it."""
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    meta = json.loads((path / "metadata.json").read_text())
    edit(meta)
    if reseal:
        from distframe.checkpoint.format import METADATA_CHECKSUM, metadata_checksum
        meta[METADATA_CHECKSUM] = metadata_checksum(meta)
    (path / "metadata.json").write_text(json.dumps(meta))
    return path


def _load(backend, path):
    model = STRATEGIES["zero3"][0](build_model(seed=4), backend)
    opt = STRATEGIES["zero3"][1](model, torch.optim.Adam, lr=1e-2)
    try:
        checkpoint.load(path, model, opt)
    except CheckpointError as exc:
        return str(exc)


@pytest.mark.parametrize("edit, says", [
    (lambda m: m.pop("files"), "'files' is missing"),
    (lambda m: m.pop("parameters"), "'parameters' is missing"),
    (lambda m: m.pop("replicated"), "'replicated' is missing"),
    (lambda m: m.update(parameters=[]), "'parameters' is a list, not a dict"),
    (lambda m: m["files"][1].pop("sha256"), "files[1] does not hold"),
    (lambda m: m["files"][0].update(file="../elsewhere.safetensors"), "not a file in the checkpoint's"),
    (lambda m: m["parameters"]["0.weight"].pop("shape"), "parameter '0.weight' has no shape"),
    (lambda m: m["optimizer"].pop("scalars"), "'optimizer' does not hold"),
    (lambda m: m.update(step="1"), "'step' is '1', not a whole number"),
])
def test_edited_metadata_is_named_in_a_checkpoint_error(saved, tmp_path, edit, says):
    # Each of these raised KeyError (or TypeError) from the reader: consolidate's caller got no
    # CheckpointError to catch, and no word of which file was wrong.
    path = _edited(saved, tmp_path, edit)
    with pytest.raises(CheckpointError) as raised:
        checkpoint.consolidate(path)
    assert str(path / "metadata.json") in str(raised.value) and says in str(raised.value)
    for message in spawn(lambda b: _load(b, path), 2, timeout=30):
        assert message is not None and "failed on ranks [0, 1] of 2" in message and says in message


def test_a_checkpoint_without_aliases_still_loads(saved, tmp_path):
    # Saved before tied weights were recorded: no "aliases" key, which is not an error.
    path = _edited(saved, tmp_path, lambda m: (_legacy(m), m.pop("aliases")), reseal=False)
    expected = checkpoint.consolidate(saved)
    for name, value in checkpoint.consolidate(path).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)
    assert spawn(lambda b: _load(b, path), 2, timeout=30) == [None, None]


def _save_at(backend, path, step):
    model = STRATEGIES["ddp"][0](build_model(), backend)
    try:
        checkpoint.save(path, model, step=step)
    except Exception as exc:  # noqa: BLE001 - returned to the test to inspect
        return type(exc), str(exc)


@pytest.mark.parametrize("step", [np.int64(7), torch.tensor(7)])
def test_a_numpy_or_torch_step_is_saved_as_an_int(tmp_path, step):
    # JSON cannot write these: the save failed after every rank had written its file.
    path = tmp_path / "ckpt"
    assert spawn(lambda b: _save_at(b, path, step), 2, timeout=30) == [None, None]
    assert json.loads((path / "metadata.json").read_text())["step"] == 7


@pytest.mark.parametrize("step", [7.5, "7", True])
def test_a_step_that_is_not_a_whole_number_is_refused_before_anything_is_written(tmp_path, step):
    for kind, message in spawn(lambda b: _save_at(b, tmp_path / "ckpt", step), 2, timeout=30):
        assert kind is ConfigError and "step must be a whole number" in message, message
    assert list(tmp_path.iterdir()) == []


def test_a_whole_float_step_saved_by_an_earlier_distframe_loads(saved, tmp_path):
    path = _edited(saved, tmp_path, lambda m: (_legacy(m), m.update(step=1.0)), reseal=False)
    assert spawn(lambda b: _load(b, path), 2, timeout=30) == [None, None]


def _legacy(meta):
    """As a distframe before the metadata checksum (format version 1) wrote it."""
    meta.pop("metadata_sha256", None)
    meta["format_version"] = 1


@pytest.mark.parametrize("edit", [
    lambda m: m["parameters"]["0.weight"].update(shape=[6, 17]),  # was [17, 6]: same element count
    lambda m: m.update(step=2),
    lambda m: m["optimizer"]["param_groups"][0].update(lr=0.5),
    lambda m: m.update(strategy="DDPModel"),
])
def test_an_edit_to_the_metadata_is_refused_as_a_modified_file(saved, tmp_path, edit):
    # The reshape was silent: consolidate returned 0.weight as a (6, 17) tensor of the saved
    # numbers in the wrong places; a changed step or learning rate loaded without a word.
    path = _edited(saved, tmp_path, edit, reseal=False)
    says = [str(path / "metadata.json"), "modified or corrupted"]
    with pytest.raises(CheckpointError) as raised:
        checkpoint.consolidate(path)
    assert all(s in str(raised.value) for s in says), raised.value
    for message in spawn(lambda b: _load(b, path), 2, timeout=30):
        assert message is not None and "failed on ranks [0, 1] of 2" in message
        assert all(s in message for s in says), message


def test_a_current_checkpoint_whose_checksum_was_removed_is_refused(saved, tmp_path):
    path = _edited(saved, tmp_path, lambda m: m.pop("metadata_sha256", None), reseal=False)
    with pytest.raises(CheckpointError, match="modified or corrupted"):
        checkpoint.consolidate(path)


def test_a_reformatted_metadata_file_still_loads(saved, tmp_path):
    # The checksum covers the content, not its layout: keys reordered, indentation changed.
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    meta = json.loads((path / "metadata.json").read_text())
    (path / "metadata.json").write_text(json.dumps(dict(reversed(meta.items())), indent=4))
    expected = checkpoint.consolidate(saved)
    for name, value in checkpoint.consolidate(path).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)


def test_a_checkpoint_saved_before_the_metadata_checksum_still_loads(saved, tmp_path):
    path = _edited(saved, tmp_path, _legacy, reseal=False)
    expected = checkpoint.consolidate(saved)
    for name, value in checkpoint.consolidate(path).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)
    assert spawn(lambda b: _load(b, path), 2, timeout=30) == [None, None]
    assert json.loads((saved / "metadata.json").read_text())["format_version"] == 2
