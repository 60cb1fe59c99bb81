"""The corpus and the batches: real text by default, deterministic splits, and global batches
that do not depend on the world size."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from distframe.data import (BatchSampler, in_validation_split, load_corpus, validation_offsets)
from distframe.errors import ConfigError


def test_default_corpus_is_the_standard_library():
    corpus = load_corpus(None)
    assert corpus.vocab_size == 256 and "standard library" in corpus.description
    assert len(corpus.train) > 1_000_000 and len(corpus.validation) > 10_000
    assert b"def " in corpus.train[:100_000].tobytes()
    again = load_corpus(None)  # the split is a function of the paths alone
    assert len(again.validation) == len(corpus.validation)
    assert np.array_equal(again.validation[:1000], corpus.validation[:1000])


def test_split_by_path_hash_is_stable():
    names = [f"pkg/module_{i}.py" for i in range(400)]
    chosen = [n for n in names if in_validation_split(n)]
    assert 5 <= len(chosen) <= 40
    assert chosen == [n for n in names if in_validation_split(n)]


@pytest.mark.parametrize("seed", [0, 7])
def test_global_batch_is_the_same_at_every_world_size(seed):
    tokens = np.arange(10_000, dtype=np.uint16) % 251
    sampler = BatchSampler(tokens, batch_size=8, seq_len=16, seed=seed)
    for step in (1, 2, 50):
        whole = sampler.slice(step, 0, 1)
        for world in (2, 4, 8):
            parts = [sampler.slice(step, r, world) for r in range(world)]
            assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
            assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])
        inputs, targets = whole
        assert inputs.dtype == torch.int64 and inputs.shape == (8, 16)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are shifted by one
    assert not torch.equal(sampler.slice(1, 0, 1)[0], sampler.slice(2, 0, 1)[0])


def test_validation_windows_cover_the_split():
    offsets = validation_offsets(1000, batches=3, batch_size=4, seq_len=10)
    flat = np.concatenate(offsets)
    assert len(offsets) == 3 and flat[0] == 0 and flat[-1] == 1000 - 11
    with pytest.raises(ConfigError, match="--seq-len"):
        validation_offsets(5, batches=1, batch_size=1, seq_len=10)


def test_directory_of_text_files(tmp_path):
    for i in range(60):
        (tmp_path / f"file{i}.txt").write_text(f"text number {i}\n" * 20)
    (tmp_path / "image.bin.dat").write_bytes(b"\0\1\2" * 100)  # binary: skipped
    (tmp_path / ".hidden").write_text("secret")
    corpus = load_corpus(str(tmp_path))
    text = corpus.train.tobytes() + corpus.validation.tobytes()
    assert b"\0" not in text and b"secret" not in text
    assert len(corpus.validation) > 0 and len(corpus.train) > len(corpus.validation)


def test_single_text_file_keeps_its_tail_for_validation(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes(bytes(range(256)) * 40)
    corpus = load_corpus(str(path))
    assert len(corpus.validation) == 40 * 256 * 5 // 100
    assert corpus.train.tobytes() + corpus.validation.tobytes() == path.read_bytes()


def test_token_files_are_memory_mapped(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(3000, dtype=np.uint16).tofile(path)
    corpus = load_corpus(str(path), token_dtype="uint16")
    assert isinstance(corpus.train, np.memmap) and corpus.vocab_size == 3000
    assert len(corpus.train) + len(corpus.validation) == 3000
    as_bytes = load_corpus(str(path), token_dtype="uint8")
    assert as_bytes.vocab_size == 256 and len(as_bytes.train) + len(as_bytes.validation) == 6000
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\1\2\3")
    with pytest.raises(ConfigError, match="uint16"):
        load_corpus(str(odd), token_dtype="uint16")


def test_too_little_data(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("x")
    with pytest.raises(ConfigError, match="too little"):
        load_corpus(str(path))
    with pytest.raises(ConfigError, match="--seq-len"):
        BatchSampler(np.zeros(10, dtype=np.uint8), batch_size=1, seq_len=32, seed=0)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_data_that_is_neither_file_nor_directory(tmp_path):
    """It exists (as /dev/null does): the error must not say there is no such file."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_corpus(str(pipe))
