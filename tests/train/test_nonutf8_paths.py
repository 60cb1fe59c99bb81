"""Checkpoint paths that are not UTF-8: safetensors cannot open such a file, so a run with such an
--out trained and then wrote checkpoints that neither generate (a SafetensorError traceback) nor
--resume could load. Such an --out or --checkpoint is refused up front in one line, and a
checkpoint moved to such a path is a CheckpointError that names the file and says what to do."""
from __future__ import annotations

import io
import os
import shutil
import sys

import pytest

from distframe import checkpoint
from distframe.cli import main
from tests.train.conftest import TINY, train


def _latin1(directory, name: str) -> str:
    """``directory/name\\xe9`` as Python holds a name that is not UTF-8 (surrogate escapes);
    skipped where the file system refuses such names."""
    path = os.path.join(os.fsencode(directory), name.encode() + b"\xe9")
    try:
        os.mkdir(path)
        os.rmdir(path)
    except OSError:
        pytest.skip("this file system takes only UTF-8 names")
    return os.fsdecode(path)


def _fails_with(argv: list[str], *needles: str) -> str:
    # sys.stderr as the interpreter's own: it escapes what it cannot encode (a surrogate escape,
    # as \udce9), where pytest's capture is strict UTF-8. (Set here: pytest sets sys.stderr
    # again as each test's call starts.)
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace",
                              write_through=True)
    saved, sys.stderr = sys.stderr, stream
    try:
        status = main(argv)
    finally:
        sys.stderr = saved
    err = stream.buffer.getvalue().decode()
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus_file):
    out = tmp_path_factory.mktemp("run")
    train(out, corpus_file, "--steps", "1", "--world-size", "1", "--eval-batches", "1")
    return out


def test_a_fresh_run_refuses_such_an_out(tmp_path, corpus_file):
    out = _latin1(tmp_path, "out")
    _fails_with(["train", *TINY, "--data", corpus_file, "--out", out, "--steps", "1",
                         "--world-size", "1"],
                "--out ", "use a path that is valid UTF-8 (safetensors cannot open others)")
    assert not os.path.exists(out)


def test_resume_refuses_such_an_out(run, tmp_path):
    moved = _latin1(tmp_path, "moved")
    shutil.copytree(run, moved)
    _fails_with(["train", "--out", moved, "--resume", "--steps", "2"],
                "--out ", "use a path that is valid UTF-8")


def test_generate_refuses_such_a_checkpoint(run, tmp_path):
    moved = _latin1(tmp_path, "moved")
    shutil.copytree(run, moved)
    for path in (moved, os.path.join(moved, "checkpoints", "step-1")):
        _fails_with(["generate", "--checkpoint", path, "--tokens", "2"],
                    "--checkpoint ", "use a path that is valid UTF-8")


def test_reading_such_a_checkpoint_names_the_file(run, tmp_path):
    moved = _latin1(tmp_path, "moved")
    shutil.copytree(run / "checkpoints" / "step-1", moved)
    with pytest.raises(checkpoint.CheckpointError, match="is not valid UTF-8.*move or rename") as info:
        checkpoint.consolidate(moved)
    assert "shard-00000-of-00001.safetensors" in str(info.value)
