"""``distframe generate`` builds the model a checkpoint holds from the model configuration saved in
that checkpoint, so a checkpoint copied elsewhere samples as it did in its run, and never loads
with another run's segment lengths or dilation rates (same shapes, another function); checkpoints
saved without it are read with their run's OUT/config.json, as before."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from distframe import generate
from distframe.checkpoint.format import METADATA_CHECKSUM, metadata_checksum
from distframe.cli import main
from tests.train.conftest import train

GREEDY = ("--prompt", "def ", "--tokens", "12", "--temperature", "0")


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus_file):
    out = tmp_path_factory.mktemp("run")
    train(out, corpus_file, "--steps", "2", "--world-size", "1", "--eval-batches", "1")
    return out


def _generate(capsys, checkpoint) -> str:
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(checkpoint), *GREEDY]) == 0
    return capsys.readouterr().out


def _logits(checkpoint) -> torch.Tensor:
    """The loaded model's output on a fixed sequence (greedy samples of a barely trained model are
    all spaces, whatever its attention does)."""
    model = generate.load_model(str(checkpoint))
    tokens = torch.arange(model.config.seq_len).reshape(1, -1) * 7 % 256
    with torch.no_grad():
        return model(tokens)


def _with_other_segments(config_json) -> None:
    """Another run's configuration with the same parameter shapes: other segment lengths and
    dilation rates, the model computes another function with the same weights."""
    config = json.loads(config_json.read_text())
    config["model"].update(segment_lengths=[4, 8, 16], dilation_rates=[1, 1, 2])
    config_json.write_text(json.dumps(config))


def test_the_checkpoint_holds_its_model_configuration(run):
    meta = json.loads((run / "checkpoints" / "step-2" / "metadata.json").read_text())
    saved = json.loads((run / "config.json").read_text())
    assert meta["info"]["model"] == saved["model"]


def test_a_copied_checkpoint_samples_as_in_its_run(run, tmp_path, capsys):
    expected, logits = _generate(capsys, run / "checkpoints" / "step-2"), _logits(run)
    copy = tmp_path / "elsewhere" / "step-2"
    shutil.copytree(run / "checkpoints" / "step-2", copy)
    assert _generate(capsys, copy) == expected
    torch.testing.assert_close(_logits(copy), logits, rtol=0, atol=0)
    # beside another run's config.json of the same shapes: still the checkpoint's own model
    mixed = tmp_path / "other" / "checkpoints" / "step-2"
    shutil.copytree(run / "checkpoints" / "step-2", mixed)
    shutil.copy(run / "config.json", tmp_path / "other" / "config.json")
    _with_other_segments(tmp_path / "other" / "config.json")
    torch.testing.assert_close(_logits(mixed), logits, rtol=0, atol=0)


def test_a_checkpoint_saved_without_it_is_read_with_the_runs_config_json(run, tmp_path, capsys):
    logits = _logits(run)
    old = tmp_path / "old"
    shutil.copytree(run, old)
    for step in (old / "checkpoints").iterdir():
        meta = json.loads((step / "metadata.json").read_text())
        del meta["info"], meta[METADATA_CHECKSUM]
        meta[METADATA_CHECKSUM] = metadata_checksum(meta)
        (step / "metadata.json").write_text(json.dumps(meta))
    torch.testing.assert_close(_logits(old), logits, rtol=0, atol=0)
    _with_other_segments(old / "config.json")  # what it reads: config.json decides the function
    assert not torch.equal(_logits(old), logits)
    (old / "config.json").unlink()
    assert main(["generate", "--checkpoint", str(old)]) == 2
    assert "config.json is missing" in capsys.readouterr().err
