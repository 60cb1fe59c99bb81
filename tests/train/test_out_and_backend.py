"""``--out`` that cannot be written and the engine ``--backend auto`` picks under a launcher:
found before any rank trains, in one line that says what to change."""
from __future__ import annotations

import os

import pytest

from tests.train.conftest import TINY
from tests.train.test_bad_input import _fails_with


@pytest.mark.parametrize("root", ["/proc", "/sys"])
def test_out_that_cannot_be_written(capsys, corpus_file, root):
    """Kernel file systems refuse new directories even to root (ENOENT, EPERM): the run used to
    end in an OSError's traceback from inside a rank (or a bare "[Errno 2] ..." line)."""
    if not os.path.isdir(root):
        pytest.skip(f"no {root} here")
    out = os.path.join(root, "distframe-test-run")
    for world in ("1", "2"):
        _fails_with(capsys, ["train", *TINY, "--data", corpus_file, "--out", out, "--steps", "1",
                             "--world-size", world], f"--out {out}", "cannot write there",
                    "directory you can write to")
    assert not os.path.exists(out)
