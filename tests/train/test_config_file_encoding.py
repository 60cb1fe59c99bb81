"""A ``--config`` file that is not UTF-8 (TOML files must be) is bad input like any other
unreadable config file: exit status 2 and one line naming the file, not a UnicodeDecodeError."""
from __future__ import annotations

from tests.train.conftest import TINY
from tests.train.test_bad_input import _fails_with


def test_a_config_file_that_is_not_utf8(capsys, tmp_path):
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b"steps = 2\n# caf\xe9\n")  # an e-acute saved as Latin-1
    line = _fails_with(capsys, ["train", *TINY, "--out", str(tmp_path / "run"), "--config", str(latin1)],
                       f"--config {latin1}: not valid TOML", "UTF-8", "0xe9")
    assert "line 2" in line
