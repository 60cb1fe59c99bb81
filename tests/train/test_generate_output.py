"""``distframe generate`` writes the sampled bytes to stdout as they are: a stdout that is not
UTF-8 was a UnicodeEncodeError traceback, and bytes that are not UTF-8 came out as U+FFFD. A
reader that closes the pipe early (``| head``) ends the command quietly, with status 0, where it
said "[Errno 32] Broken pipe" and exited 1 (as did ``distframe train``'s summary line)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from distframe import generate
from distframe.cli import main
from tests.train.conftest import TINY, train

# Uniform sampling over all 256 bytes: the output is almost surely not valid UTF-8.
RANDOM = ("--prompt", "a", "--tokens", "30", "--temperature", "1e9", "--top-k", "0", "--seed", "3")


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus_file):
    out = tmp_path_factory.mktemp("run")
    train(out, corpus_file, "--steps", "1", "--world-size", "1", "--eval-batches", "1")
    return out


@pytest.fixture(scope="module")
def expected(run) -> bytes:
    """What RANDOM samples from ``run``, as bytes."""
    sampled = generate.sample(generate.load_model(str(run)), b"a", max_new_tokens=30,
                              temperature=1e9, top_k=0, seed=3)
    with pytest.raises(UnicodeDecodeError):
        sampled.decode("utf-8")
    return sampled


def _generate(run, *flags: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **kwargs.pop("env", {})}
    return subprocess.Popen([sys.executable, "-m", "distframe", "generate", "--checkpoint", str(run),
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, **kwargs)


def test_the_bytes_are_written_as_sampled(run, expected, capfdbinary):
    assert main(["generate", "--checkpoint", str(run), *RANDOM]) == 0  # stdout: a file
    assert capfdbinary.readouterr().out == expected + b"\n"


def test_a_stdout_in_memory_takes_text(run, expected, capsys):
    # capsys's stream reads back as strict UTF-8: it takes text, invalid bytes replaced
    assert main(["generate", "--checkpoint", str(run), *RANDOM]) == 0
    assert capsys.readouterr().out == expected.decode("utf-8", errors="replace") + "\n"


def test_a_stdout_that_is_not_utf8(run, expected):
    proc = _generate(run, *RANDOM, env={"PYTHONIOENCODING": "latin-1"})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err == b"", err.decode(errors="replace")
    assert out == expected + b"\n"


def test_a_reader_that_closes_the_pipe(run):
    proc = _generate(run, "--tokens", "50")
    proc.stdout.close()  # before the model has loaded: its write meets a pipe without a reader
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err.decode(errors="replace")
    assert err == b""


class _GoneReader:
    """A stdout whose reader has gone, unbuffered: writing anything fails with EPIPE."""

    def write(self, text: str) -> int:
        if text:
            raise BrokenPipeError(32, "Broken pipe")
        return 0

    def flush(self) -> None:
        pass


def test_train_with_the_reader_of_its_stdout_gone(tmp_path, corpus_file, capsys):
    # In process: the summary line's write fails; no stdout file descriptor to point at os.devnull.
    saved, sys.stdout = sys.stdout, _GoneReader()
    try:
        status = main(["train", *TINY, "--data", corpus_file, "--out", str(tmp_path), "--steps", "1",
                       "--world-size", "1", "--eval-batches", "1"])
    finally:
        sys.stdout = saved
    err = [line for line in capsys.readouterr().err.splitlines() if "Broken pipe" in line]
    assert status == 0 and not err, err
