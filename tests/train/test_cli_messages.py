"""The command's own messages: ``--version``, an unknown argument pointing at the command's
--help, and ``generate`` from a damaged checkpoint naming the intact one before it."""
from __future__ import annotations

import pytest

import distframe
from distframe.cli import main
from tests.train.conftest import train


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"distframe {distframe.__version__}"


@pytest.mark.parametrize("command", ["train", "generate"])
def test_an_unknown_argument_points_at_the_commands_help(capsys, command):
    argv = [command, "foo"] if command == "train" else [command, "--checkpoint", "x", "foo"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "unrecognized arguments: foo" in err and f"(see distframe {command} --help)" in err
    assert err.count("\n") == 0


def test_generate_from_a_damaged_checkpoint_names_the_intact_one(tmp_path, corpus_file, capsys):
    train(tmp_path, corpus_file, "--steps", "2", "--checkpoint-every", "1", "--world-size", "1",
          "--eval-batches", "1")
    shard = sorted((tmp_path / "checkpoints" / "step-2").glob("shard-*"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path), "--tokens", "4"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    intact = tmp_path / "checkpoints" / "step-1"
    assert len(err) == 1 and "is damaged" in err[0] and f"pass --checkpoint {intact}" in err[0]
    assert main(["generate", "--checkpoint", str(intact), "--tokens", "4"]) == 0
