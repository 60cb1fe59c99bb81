"""``--resume`` whose latest checkpoint is damaged (a shard truncated or missing, metadata.json
cut short) stops with one line that names the damaged checkpoint and the latest intact one, and
how to continue from it; it deletes nothing, and once the damaged one is moved away, --resume
continues from the intact one."""
from __future__ import annotations

import shutil

import pytest

from distframe.cli import main
from tests.train.conftest import TINY, read_metrics, train

FLAGS = ("--steps", "6", "--checkpoint-every", "2", "--eval-batches", "1", "--world-size", "2")


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus_file):
    out = tmp_path_factory.mktemp("run") / "run"
    train(out, corpus_file, *FLAGS)
    return out


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


DAMAGE = {
    "truncated shard": lambda step: _truncate(sorted(step.glob("shard-*"))[1]),
    "missing shard": lambda step: sorted(step.glob("shard-*"))[0].unlink(),
    "truncated metadata": lambda step: _truncate(step / "metadata.json"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_latest_checkpoint_names_the_intact_one(run, tmp_path, corpus_file, capsys, damage):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    DAMAGE[damage](out / "checkpoints" / "step-6")
    DAMAGE[damage](out / "checkpoints" / "step-4")  # the one before it too: step-2 is the intact one
    files = sorted(p.name for p in (out / "checkpoints").rglob("*"))
    capsys.readouterr()
    argv = ["train", *TINY, "--data", corpus_file, "--out", str(out), "--resume", *FLAGS[2:],
            "--steps", "8"]
    assert main(argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    bad, good = out / "checkpoints" / "step-6", out / "checkpoints" / "step-2"
    assert f"{bad} is damaged" in err[0] and f"{good} is the latest intact" in err[0]
    assert "move" in err[0] and "from step 2" in err[0]
    assert sorted(p.name for p in (out / "checkpoints").rglob("*")) == files  # nothing deleted
    # as the line says: move the damaged ones away and resume again
    for step in ("step-6", "step-4"):
        shutil.move(out / "checkpoints" / step, out / f"{step}.damaged")
    assert main(argv) == 0
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 9))


def test_no_intact_checkpoint_is_said_too(run, tmp_path, corpus_file, capsys):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    for step in (out / "checkpoints").iterdir():
        DAMAGE["missing shard"](step)
    capsys.readouterr()
    assert main(["train", *TINY, "--data", corpus_file, "--out", str(out), "--resume", *FLAGS[2:],
                 "--steps", "8"]) == 1
    err = capsys.readouterr().err
    assert "is damaged" in err and "no earlier checkpoint in" in err and "is intact" in err


def test_a_finished_run_whose_last_checkpoint_is_damaged_is_not_called_finished(run, tmp_path, corpus_file,
                                                                                 capsys):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    DAMAGE["truncated shard"](out / "checkpoints" / "step-6")
    capsys.readouterr()
    argv = ["train", *TINY, "--data", corpus_file, "--out", str(out), "--resume", *FLAGS]
    assert main(argv) == 1
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert len(err) == 1 and "already reached" not in captured.out, (captured.out, err)
    assert f"{out / 'checkpoints' / 'step-6'} is damaged" in err[0]
    assert f"{out / 'checkpoints' / 'step-4'} is the latest intact" in err[0]
    shutil.move(out / "checkpoints" / "step-6", out / "step-6.damaged")
    assert main(argv) == 0  # steps 5 and 6 again, and a new, intact step-6
    assert [r["step"] for r in read_metrics(out)][-2:] == [5, 6]
    assert main(argv) == 0 and "already reached step 6" in capsys.readouterr().out
