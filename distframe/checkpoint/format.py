"""The on-disk format of a sharded checkpoint: names, metadata, checksums, and a reader.

A checkpoint is a directory holding ``metadata.json`` and one safetensors file per saving rank
(``shard-<rank>-of-<world>.safetensors``). Tensors are 1-D pieces keyed
``<kind>/<parameter>@<offset>`` (kind ``param`` or ``optim.<state key>``, see
distframe.models.sharded_state) plus whole ``buffer/<name>`` tensors, so any strategy at any world
size can read the ranges it needs. Metadata records the format version, strategy, world size,
step, every parameter's shape and dtype, each file's pieces, size and sha256, and the optimizer's
hyperparameters and per-parameter scalars. A complex tensor is stored as its real view, which the
file's own metadata names (``complex_views``); the reader gives it back complex.

[Note: the metadata's own checksum]
The shard files are checked against the sha256 the metadata records, but the metadata itself
could be edited unnoticed: a parameter's shape changed to another with as many elements made
``consolidate`` reshape the saved numbers into the wrong places, a changed step or learning rate
loaded without a word. Since format version 2, metadata.json also records ``metadata_sha256``:
the sha256 of its own content in canonical form (``json.dumps`` with sorted keys and no
whitespace, that key left out), so re-indenting or reordering the file keeps it valid, and any
change to a value (or the key's removal) is refused with a CheckpointError naming the file.
Checkpoints of format version 1 (written before) have no such key and are read as before,
unchecked. This guards against accidents (a hand edit, a damaged disk), not against someone who
means to forge a checkpoint: they can recompute the checksum.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from distframe.checkpoint import complex_views
from distframe.errors import DistFrameError
from distframe.models.sharded_state import RangeReader

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: without METADATA_CHECKSUM
METADATA = "metadata.json"
METADATA_CHECKSUM = "metadata_sha256"


class CheckpointError(DistFrameError, RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


SHARD_FILE = re.compile(r"shard-\d+-of-\d+\.safetensors")  # the names shard_file_name gives


def shard_file_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def metadata_checksum(meta: dict[str, Any]) -> str:
    """The sha256 of ``meta``'s canonical JSON (sorted keys, no whitespace), METADATA_CHECKSUM
    left out; ``meta`` as JSON reads it back (lists, string keys)."""
    content = {k: v for k, v in meta.items() if k != METADATA_CHECKSUM}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def write_metadata(directory: Path, meta: dict[str, Any]) -> None:
    """``directory/metadata.json``: ``meta`` with its checksum, flushed to disk."""
    meta = json.loads(json.dumps(meta))  # what a reader will parse: tuples as lists, keys as str
    meta[METADATA_CHECKSUM] = metadata_checksum(meta)
    (directory / METADATA).write_text(json.dumps(meta, indent=1))
    fsync_path(directory / METADATA)


def read_metadata(path: Path) -> dict[str, Any]:
    """The checkpoint's metadata; CheckpointError naming the file if it is absent or unreadable."""
    meta_path = path / METADATA
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint directory at {path}")
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path} is missing: the checkpoint is incomplete (a save that did "
                              "not finish leaves only a temporary directory); load an earlier one")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{meta_path} is not valid JSON ({exc}); the checkpoint is corrupt") from exc
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise CheckpointError(f"{meta_path}: format_version {version!r} is not one of "
                              f"{list(READABLE_VERSIONS)}; this distframe cannot read it")
    if version >= 2 and meta.pop(METADATA_CHECKSUM, None) != metadata_checksum(meta):
        raise CheckpointError(f"{meta_path} does not match its checksum ({METADATA_CHECKSUM}): the "
                              "file was modified or corrupted after the save; restore it from a copy "
                              "of the checkpoint or load an earlier one")
    problem = _schema_problem(meta)
    if problem is not None:
        raise CheckpointError(f"{meta_path}: {problem}; the metadata was edited or is corrupt: "
                              "restore it from a copy of the checkpoint or load an earlier one")
    return meta


def _schema_problem(meta: dict[str, Any]) -> str | None:
    """What in ``meta`` the readers below could not use (a key missing, a value of another type),
    or None; checked up front so that an edited file gives one clear error, not a KeyError."""
    expected = {"files": list, "parameters": dict, "replicated": list, "aliases": dict}
    for key, kind in expected.items():
        if key not in meta and key != "aliases":  # absent from checkpoints saved before tied weights
            return f"{key!r} is missing"
        if key in meta and not isinstance(meta[key], kind):
            return f"{key!r} is a {type(meta[key]).__name__}, not a {kind.__name__}"
    step = meta.get("step")  # a float such as 5.0 from a save before steps were checked
    if step is not None and not (isinstance(step, int) or isinstance(step, float) and step.is_integer()):
        return f"'step' is {step!r}, not a whole number"
    for i, entry in enumerate(meta["files"]):
        fields = {"file": str, "bytes": int, "sha256": str, "tensors": dict}
        if not isinstance(entry, dict) or any(not isinstance(entry.get(k), t) for k, t in fields.items()):
            return f"files[{i}] does not hold {sorted(fields)}"
        if Path(entry["file"]).name != entry["file"] or entry["file"] in (".", ".."):
            return f"files[{i}] names {entry['file']!r}, not a file in the checkpoint's directory"
    for name, info in meta["parameters"].items():
        if not isinstance(info, dict) or not isinstance(info.get("shape"), list) or not all(
                isinstance(d, int) and d >= 0 for d in info["shape"]):
            return f"parameter {name!r} has no shape (a list of sizes)"
    optimizer = meta.get("optimizer")
    if optimizer is not None and not (isinstance(optimizer, dict) and isinstance(
            optimizer.get("param_groups"), list) and isinstance(optimizer.get("scalars"), dict)):
        return "'optimizer' does not hold 'param_groups' (a list) and 'scalars' (a dict)"
    return None


def verify_files(path: Path, meta: dict[str, Any], *, checksums: bool = True) -> None:
    """Every listed file exists with the recorded size and (unless ``checksums`` is False) sha256,
    else CheckpointError naming it. Without checksums it only stats the files: ``open_reader``
    with ``verify=True`` then hashes each file as the reader first opens it."""
    for entry in meta["files"]:
        file = path / entry["file"]
        if not file.is_file():
            raise CheckpointError(f"{file} is missing from the checkpoint")
        if file.stat().st_size != entry["bytes"]:
            raise CheckpointError(f"{file} has {file.stat().st_size} bytes, the metadata says "
                                  f"{entry['bytes']}: the file is truncated or was replaced")
        if checksums:
            _check_sha256(file, entry)


def _check_sha256(file: Path, entry: dict[str, Any]) -> None:
    if sha256_of(file) != entry["sha256"]:
        raise CheckpointError(f"{file} does not match its sha256 checksum: the file is corrupt")


def untied_aliases(meta: dict[str, Any], names: set[str]) -> dict[str, str]:
    """The checkpoint's aliases (a tied weight's further names, stored once) that a model whose
    tensors are ``names`` holds as tensors of their own, each mapped to the stored name: that
    model unties them, and reads each from the tensor it aliases, as torch's
    ``load_state_dict`` of the consolidated state dict would (exact values)."""
    stored = set(meta["parameters"]) | set(meta["replicated"])
    return {alias: name for alias, name in meta.get("aliases", {}).items()
            if alias in names and alias not in stored and name in stored}


def open_reader(path: Path, meta: dict[str, Any], aliases: dict[str, str] | None = None, *,
                verify: bool = False) -> RangeReader:
    """A RangeReader over every file's pieces (files are opened lazily, read by slice).
    ``aliases`` (name -> stored name): further names under which the reader also serves a
    stored tensor's pieces (a tied weight loaded into a model that unties it). ``verify``: each
    file is checked against its sha256 when first opened, so a rank hashes only the files it
    reads (with sharded state, its own and few others) rather than the whole checkpoint; a
    corrupt file is still found by every rank that reads from it, before any of its data is
    used."""
    by_target: dict[str, list[str]] = {}
    for alias, target in (aliases or {}).items():
        by_target.setdefault(target, []).append(alias)
    where: dict[str, tuple[str, str]] = {}  # key served -> (file, key stored)
    pieces: list[tuple[str, int]] = []
    entries = {entry["file"]: entry for entry in meta["files"]}
    for entry in meta["files"]:
        for key, numel in entry["tensors"].items():
            for served in (key, *_alias_keys(key, by_target)):
                where[served] = (entry["file"], key)
                pieces.append((served, numel))
    handles: dict[str, Any] = {}
    complex_held: dict[str, set[str]] = {}  # by file: the keys stored as real views (complex_views)

    def stored(key: str) -> tuple[Any, str, bool]:
        name, stored_key = where[key]
        if name not in handles:
            if verify:
                _check_sha256(path / name, entries[name])
            handles[name] = _open_shard(path / name)
            complex_held[name] = complex_views.complex_keys(handles[name])
        return handles[name], stored_key, stored_key in complex_held[name]

    def fetch(key: str, lo: int, hi: int | None) -> torch.Tensor:
        handle, stored_key, is_complex = stored(key)
        if hi is None:
            return complex_views.restored(handle.get_tensor(stored_key), is_complex)
        return complex_views.restored(handle.get_slice(stored_key)[lo:hi], is_complex)

    def shape_of(key: str) -> list[int]:
        handle, stored_key, is_complex = stored(key)
        return complex_views.restored_shape(handle.get_slice(stored_key).get_shape(), is_complex)
    return RangeReader(pieces, fetch, shape_of)


def _open_shard(file: Path) -> Any:
    """``safe_open`` of ``file``; CheckpointError naming it where its path is not UTF-8, which
    safetensors refuses (a SafetensorError traceback), as after a move into such a directory."""
    try:
        os.fsencode(file).decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{file}: the path is not valid UTF-8, which safetensors cannot open; "
                              "move or rename the checkpoint to a UTF-8 path") from None
    return safe_open(str(file), framework="pt")


def _alias_keys(key: str, by_target: dict[str, list[str]]) -> list[str]:
    """``key`` (``kind/name@offset`` or ``buffer/name``) under each alias of its tensor's name."""
    if not by_target:
        return []
    if key.startswith("buffer/"):
        return [f"buffer/{alias}" for alias in by_target.get(key.removeprefix("buffer/"), [])]
    kind, rest = key.split("/", 1)
    name, offset = rest.rsplit("@", 1)
    return [f"{kind}/{alias}@{offset}" for alias in by_target.get(name, [])]
