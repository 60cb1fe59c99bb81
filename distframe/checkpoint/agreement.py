"""Every rank learns whether every rank's part of a checkpoint save or load worked.

[Note: one failed rank]
A save or load does its local work (reading and checking files, filling shards, writing this
rank's file) on each rank alone. When that fails on some ranks only (a file missing from one
node's disk, a shape check of a stage only one rank holds, a full disk), a rank that simply raised
would leave its peers in their next collective until its timeout (minutes), and a peer whose load
needs no collective would train on as if nothing had happened. So each rank catches its own
failure and every rank calls ``agree`` at the same point: one all_gather of three int64 per
rank, after which every rank knows which ranks failed, and all of them raise, naming those ranks
and their reasons (fetched then, with all_gather_bytes, only when something failed). A load also
sends a digest of the metadata it read, so ranks that read different checkpoints under one name
(node-local copies that are not the same) raise instead of training on from different states.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from distframe.backends.objects import all_gather_bytes
from distframe.backends.protocol import ICommunicationBackend
from distframe.checkpoint.format import CheckpointError
from distframe.errors import ConfigError

_OK, _FAILED, _SETTING = 0, 1, 2  # _SETTING: a ConfigError, something the user sets
_REASONS_SHOWN = 3


def agree(backend: ICommunicationBackend, error: Exception | None, what: str,
          meta: dict[str, Any] | None = None) -> None:
    """Returns on every rank if ``error`` is None on every rank of ``backend`` (and, given
    ``meta``, the metadata a load read, every rank read the same checkpoint); else raises on
    every rank, chained to this rank's own ``error``. Collective: one all_gather of three int64;
    two more (the reasons) when some rank failed."""
    code = _OK if error is None else _SETTING if isinstance(error, ConfigError) else _FAILED
    step = -1 if meta is None or meta.get("step") is None else int(meta["step"])
    mine = torch.tensor([code, _digest(meta), step], dtype=torch.int64)
    rows = backend.all_gather(mine).view(backend.world_size, 3).tolist()
    codes = [row[0] for row in rows]
    if any(codes):
        blobs = all_gather_bytes(backend, b"" if error is None else describe_error(error).encode())
        reasons = {rank: blobs[rank].decode(errors="replace") for rank, c in enumerate(codes) if c != _OK}
        setting = all(codes[rank] == _SETTING for rank in reasons)
        raise failure(what, reasons, backend.world_size, setting=setting) from error
    if len({row[1] for row in rows}) > 1:
        raise CheckpointError(_different_checkpoints(what, rows))


def _digest(meta: dict[str, Any] | None) -> int:
    """63 bits of the metadata's sha256 (it lists every file's checksum): equal for copies of
    one checkpoint, different for any two others."""
    if meta is None:
        return 0
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _different_checkpoints(what: str, rows: list[list[int]]) -> str:
    by_digest: dict[int, list[int]] = {}
    for rank, (_, digest, _) in enumerate(rows):
        by_digest.setdefault(digest, []).append(rank)
    parts = [f"step {rows[ranks[0]][2]} on rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}"
             for ranks in list(by_digest.values())[:_REASONS_SHOWN]]
    return (f"{what}: the ranks read different checkpoints under that name ({'; '.join(parts)}"
            f"{'; ...' if len(by_digest) > _REASONS_SHOWN else ''}); give every rank the same "
            "checkpoint (copy one to every node's disk, or use a shared file system)")


def describe_error(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def failure(what: str, reasons: dict[int, str], world_size: int, *, setting: bool) -> Exception:
    """The error every rank raises when the ranks in ``reasons`` failed: ConfigError when each
    failure was one (``setting``: a setting to change), else CheckpointError; its message is
    ``"<what> failed on rank(s) ... of N: <reason>"``."""
    return (ConfigError if setting else CheckpointError)(_describe(what, reasons, world_size))


def _describe(what: str, reasons: dict[int, str], world_size: int) -> str:
    """One line per distinct reason, with the ranks that gave it (the first few reasons only)."""
    failed = sorted(reasons)
    by_reason: dict[str, list[int]] = {}
    for rank in failed:
        by_reason.setdefault(reasons[rank], []).append(rank)
    where = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {failed}"
    head = f"{what} failed on {where} of {world_size}"
    if len(by_reason) == 1:
        return f"{head}: {reasons[failed[0]]}"
    lines = [f"{head}:"] + [f"  rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}: {reason}"
                            for reason, ranks in list(by_reason.items())[:_REASONS_SHOWN]]
    if len(by_reason) > _REASONS_SHOWN:
        lines.append(f"  and {len(by_reason) - _REASONS_SHOWN} further reasons on other ranks")
    return "\n".join(lines)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
