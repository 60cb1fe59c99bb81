"""``--data`` edges: a file whose name is not UTF-8 inside a directory is trained on (it was a
UnicodeEncodeError traceback), and empty data is refused in one line that says what to add
(an empty .bin was told to change --token-dtype; empty files counted the separators between them)."""
from __future__ import annotations

import hashlib
import os

import pytest

from distframe.data import VALIDATION_PERCENT, in_validation_split, load_corpus
from tests.train.conftest import TINY, train
from tests.train.test_bad_input import _fails_with


@pytest.fixture
def latin1_named_dir(tmp_path):
    """Thirty UTF-8-named text files and one named ``caf\\xe9.txt`` (as unpacked from a latin-1
    zip); skipped where the file system refuses such a name (macOS, Windows)."""
    directory = tmp_path / "data"
    directory.mkdir()
    for i in range(30):
        (directory / f"f{i}.txt").write_text("hello world\n" * 300)
    try:
        with open(os.path.join(os.fsencode(directory), b"caf\xe9.txt"), "wb") as f:
            f.write(b"latin-1 named file\n" * 300)
    except OSError:
        pytest.skip("this file system takes only UTF-8 names")
    return directory


def test_the_split_of_a_valid_name_is_unchanged():
    # The split is the sha256 of the name's UTF-8 bytes, as before: existing splits (and so the
    # corpus digests resumed runs compare) stay the same.
    for name in ("a.txt", "sub/b.py", "café.txt", "日本.txt", *(f"v{i}.txt" for i in range(200))):
        digest = hashlib.sha256(name.encode("utf-8")).digest()
        assert in_validation_split(name) == (int.from_bytes(digest[:8], "big") % 100 < VALIDATION_PERCENT)


def test_a_name_that_is_not_utf8_is_split_by_its_bytes():
    name = os.fsdecode(b"caf\xe9.txt")  # how os.walk gives it: a surrogate escape
    digest = hashlib.sha256(b"caf\xe9.txt").digest()
    assert in_validation_split(name) == (int.from_bytes(digest[:8], "big") % 100 < VALIDATION_PERCENT)


def test_a_directory_holding_a_name_that_is_not_utf8(latin1_named_dir, tmp_path):
    corpus = load_corpus(str(latin1_named_dir))
    text = corpus.train.tobytes() + corpus.validation.tobytes()
    assert b"latin-1 named file" in text and b"hello world" in text
    metrics = train(tmp_path / "out", str(latin1_named_dir), "--steps", "1", "--world-size", "1",
                    "--eval-batches", "1")
    assert metrics[-1]["step"] == 1


@pytest.mark.parametrize("dtype", ["uint8", "uint16"])
def test_an_empty_token_file(tmp_path, capsys, dtype):
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    line = _fails_with(capsys, ["train", *TINY, "--data", str(empty), "--token-dtype", dtype,
                                "--out", str(tmp_path / "out"), "--world-size", "1"],
                       f"--data {empty} is empty: pass a file with tokens")
    assert "--token-dtype" not in line


@pytest.mark.parametrize(("contents", "tokens"), [([b"", b""], 0), ([b"a", b"b"], 2)])
def test_a_directory_of_too_little_text_counts_the_files_own_bytes(tmp_path, capsys, contents, tokens):
    directory = tmp_path / "data"
    directory.mkdir()
    for i, content in enumerate(contents):
        (directory / f"{i}.txt").write_bytes(content)
    _fails_with(capsys, ["train", *TINY, "--data", str(directory), "--out", str(tmp_path / "out"),
                         "--world-size", "1"],
                f"--data {directory}: too little text ({tokens} tokens) to train on; add text or pass "
                "a larger --data")
