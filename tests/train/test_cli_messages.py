"""The command's own messages: ``--version``, an unknown argument pointing at the command's
--help, and ``generate`` from a damaged checkpoint naming the intact one before it."""
from __future__ import annotations

import pytest

import distframe
from distframe.cli import main
from tests.train.conftest import TINY, train


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


def test_an_unreadable_data_file_is_one_line(tmp_path, corpus_file, capsys, monkeypatch):
    # A PermissionError (a file of another user's, mode 600) was a traceback: the tests run as
    # root, who may read anything, so the open itself is made to fail as it would for a user.
    import distframe.train_loop

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(distframe.train_loop, "load_corpus", refuse)
    assert main(["train", *TINY, "--data", corpus_file, "--out", str(tmp_path / "o"), "--steps", "1",
                 "--world-size", "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "Permission denied" in err[0] and corpus_file in err[0], err


def test_every_ranks_reason_is_on_the_one_line(capsys):
    # Ranks that failed a save for different reasons: the reasons were on lines the CLI dropped,
    # leaving "failed on ranks [0, 1] of 2:" and nothing after it.
    from distframe.checkpoint.agreement import failure
    from distframe.cli import _report
    exc = failure("saving checkpoint out/step-4", {0: "OSError: [Errno 28] No space left on device",
                                                   1: "SafetensorError: I/O error"}, 2, setting=False)
    assert _report(exc, False, 1) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert "ranks [0, 1] of 2: rank 0: OSError: [Errno 28] No space left on device; rank 1: " \
           "SafetensorError: I/O error (--debug" in err[0], err
