"""Training data for ``distframe train``: a corpus of tokens split into train and validation,
and batches that are a pure function of (seed, step) so runs are reproducible and resumable.

Sources (``load_corpus``):
- ``None``: the Python standard library's own ``.py`` files, read as bytes from the running
  interpreter's installation (no download). A file is in the validation split when the SHA-256
  of its path relative to the library root falls in the first ``VALIDATION_PERCENT`` of hashes.
- a directory: every regular file below it (hidden entries, files with NUL bytes and the run's
  own ``--out``, passed as ``exclude``, skipped: a run must not train on its own metrics and
  checkpoints), split the same way by relative path.
- a ``.bin`` file: flat uint8 or uint16 tokens, memory-mapped.
- any other file: text, read as bytes.
A single file (or a directory whose files all fall into one split, or whose split by path
leaves a side shorter than one ``window`` of tokens, as when one tiny file hashes into
validation) keeps its last ``VALIDATION_PERCENT`` of tokens for validation. Bytes are tokens
(vocabulary 256).

Batches (``BatchSampler``): the global batch of step s is ``batch_size`` windows of
``seq_len + 1`` tokens at offsets drawn from a generator seeded by (seed, s); data-parallel rank
r of n reads only rows ``[r*b/n, (r+1)*b/n)``, so the global batch is the same at every world size.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sysconfig

import numpy as np
import torch

from distframe.errors import ConfigError

VALIDATION_PERCENT = 5
_SEPARATOR = b"\n\n"


@dataclasses.dataclass(frozen=True)
class TokenCorpus:
    """``train`` and ``validation`` token arrays (uint8 or uint16, possibly memory-mapped)."""

    train: np.ndarray
    validation: np.ndarray
    vocab_size: int
    description: str

    @functools.cached_property
    def digest(self) -> str:
        """sha256 of the tokens of both splits (a resumed run compares it with the saved run's),
        about 1 s per GB; of a split over 512 MiB, its length and its first and last 256 MiB."""
        h, part = hashlib.sha256(), 256 << 20
        for tokens in (self.train, self.validation):
            data = np.ascontiguousarray(tokens).view(np.uint8)
            if data.nbytes > 2 * part:
                h.update(str(data.nbytes).encode())
                data = np.concatenate([data[:part], data[-part:]])
            h.update(data.data)
        return h.hexdigest()


def load_corpus(path: str | None, *, token_dtype: str = "uint8", exclude: str | None = None,
                window: int = 0) -> TokenCorpus:
    """The corpus at ``path`` (see the module docstring); ConfigError if it cannot be used.
    ``exclude``: a directory a directory's walk leaves out (the run's --out); ``window``: the
    tokens of one training window (seq_len + 1), which each split of a directory must hold."""
    own = None  # a directory's tokens without the separators between its files
    if path is None:
        root = sysconfig.get_paths()["stdlib"]
        files = _python_sources(root)
        corpus, own = _split_files(root, files, f"Python {sysconfig.get_python_version()} standard "
                                                 f"library sources ({len(files)} files)", window)
    elif os.path.isdir(path):
        excluded = _inside(exclude, path)
        description = f"text files under {path}" + (f" (without --out {exclude})" if excluded else "")
        corpus, own = _split_files(path, _text_files(path, excluded), description, window)
    elif not os.path.exists(path):
        raise ConfigError(f"--data {path}: no such file or directory")
    elif not os.path.isfile(path):  # a device such as /dev/null, a pipe, a socket
        raise ConfigError(f"--data {path}: not a regular file or a directory; pass a text file, a "
                          "directory of text files or a .bin token file")
    elif path.endswith(".bin"):
        corpus = _token_file(path, token_dtype)
    else:
        with open(path, "rb") as f:
            corpus = _tail_split(np.frombuffer(f.read(), dtype=np.uint8), 256, f"text file {path}")
    if len(corpus.train) < 2 or len(corpus.validation) < 2:
        count = len(corpus.train) + len(corpus.validation) if own is None else own
        raise ConfigError(f"--data {path or '(default corpus)'}: too little text ({count} tokens) "
                          "to train on; add text or pass a larger --data")
    return corpus


def _python_sources(root: str) -> list[str]:
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages",
                                                             "__pycache__"))
        files += [os.path.join(directory, n) for n in sorted(names) if n.endswith(".py")]
    return files


def _inside(directory: str | None, root: str) -> str | None:
    """The real path of ``directory`` if it lies below ``root`` (a walk of root would reach it)."""
    if directory is None:
        return None
    real, real_root = os.path.realpath(directory), os.path.realpath(root)
    return real if real != real_root and real.startswith(real_root.rstrip(os.sep) + os.sep) else None


def _text_files(root: str, excluded: str | None = None) -> list[str]:
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and
                            (excluded is None or os.path.realpath(os.path.join(directory, d)) != excluded))
        for name in sorted(names):
            full = os.path.join(directory, name)
            if not name.startswith(".") and os.path.isfile(full) and not _looks_binary(full):
                files.append(full)
    if not files:
        raise ConfigError(f"--data {root}: the directory holds no text files")
    return files


def _looks_binary(path: str) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def in_validation_split(relative_path: str) -> bool:
    """Whether a file belongs to the validation split: a hash of its path, stable everywhere."""
    # A name that is not UTF-8 (a file unpacked from a latin-1 zip) reaches Python as surrogate
    # escapes (PEP 383): hash its bytes. Every UTF-8 name encodes as before, so splits stay.
    digest = hashlib.sha256(relative_path.replace(os.sep, "/").encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < VALIDATION_PERCENT


def _split_files(root: str, files: list[str], description: str, window: int = 0
                 ) -> tuple[TokenCorpus, int]:
    """The files' corpus, and how many tokens the files themselves hold (the corpus also holds
    the separators joined between them)."""
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for full in files:
        with open(full, "rb") as f:
            parts[in_validation_split(os.path.relpath(full, root))].append(f.read())
    train, validation = (np.frombuffer(_SEPARATOR.join(parts[v]), dtype=np.uint8)
                         for v in (False, True))
    # Too few files for a split by path, or a side too short for one window (a tiny file hashed
    # into validation): the data may still be plenty, so split its tail off instead.
    own = sum(len(text) for text in parts[False] + parts[True])
    if not parts[False] or not parts[True] or min(len(train), len(validation)) < window:
        joined = np.frombuffer(_SEPARATOR.join(parts[False] + parts[True]), dtype=np.uint8)
        return _tail_split(joined, 256, description), own
    return TokenCorpus(train, validation, 256, description), own


def _token_file(path: str, token_dtype: str) -> TokenCorpus:
    dtype = np.dtype(token_dtype)
    size = os.path.getsize(path)
    if size == 0:  # (np.memmap refuses an empty file; no --token-dtype would help)
        raise ConfigError(f"--data {path} is empty: pass a file with tokens")
    if size % dtype.itemsize:
        raise ConfigError(f"--data {path}: {size} bytes is not a whole number of {token_dtype} "
                          "tokens; pass --token-dtype uint8 or uint16 to match the file")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    vocab_size = 256 if dtype == np.uint8 else int(tokens.max()) + 1
    return _tail_split(tokens, vocab_size, f"{token_dtype} token file {path}")


def _tail_split(tokens: np.ndarray, vocab_size: int, description: str) -> TokenCorpus:
    cut = len(tokens) - max(1, len(tokens) * VALIDATION_PERCENT // 100)
    return TokenCorpus(tokens[:cut], tokens[cut:], vocab_size, description)


def check_windows(corpus: TokenCorpus, seq_len: int) -> None:
    """ConfigError, naming the split, unless the training and the validation split each hold one
    window of ``seq_len + 1`` tokens (checked before any rank starts)."""
    for split, tokens in (("training", corpus.train), ("validation", corpus.validation)):
        if len(tokens) < seq_len + 1:
            raise ConfigError(
                f"{corpus.description}: its {split} split holds {len(tokens)} tokens, fewer than one "
                f"window of --seq-len {seq_len} + 1 (validation takes about {VALIDATION_PERCENT}% of "
                "the data); use a shorter --seq-len or more data")


class BatchSampler:
    """Windows of ``tokens``: ``(inputs, targets)`` int64 ``(rows, seq_len)`` pairs, targets
    shifted by one. ``global_offsets(step)`` depends only on (seed, step)."""

    def __init__(self, tokens: np.ndarray, *, batch_size: int, seq_len: int, seed: int) -> None:
        if len(tokens) < seq_len + 1:
            raise ConfigError(f"the data holds {len(tokens)} tokens, fewer than one window of "
                              f"--seq-len {seq_len} + 1; use a shorter --seq-len or more data")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed

    def global_offsets(self, step: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, step])))
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)

    def slice(self, step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel rank's rows of the global batch of ``step``."""
        return self.windows(self.global_offsets(step), dp_rank, dp_size)

    def windows(self, offsets: np.ndarray, dp_rank: int, dp_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        per_rank = len(offsets) // dp_size
        mine = offsets[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        rows = np.stack([np.asarray(self.tokens[o:o + self.seq_len + 1]) for o in mine])
        rows = torch.from_numpy(rows.astype(np.int64))  # (rows, seq_len + 1)
        return rows[:, :-1], rows[:, 1:]


def validation_offsets(num_tokens: int, *, batches: int, batch_size: int, seq_len: int
                       ) -> list[np.ndarray]:
    """``batches`` global batches of windows spread evenly over the validation tokens; the same
    for every seed and world size, so validation losses of different runs compare."""
    if num_tokens < seq_len + 1:
        raise ConfigError(f"the validation split holds {num_tokens} tokens, fewer than one window "
                          f"of --seq-len {seq_len} + 1; use a shorter --seq-len or more data")
    count = batches * batch_size
    starts = np.linspace(0, num_tokens - seq_len - 1, num=count).astype(np.int64)
    return [starts[i * batch_size:(i + 1) * batch_size] for i in range(batches)]
