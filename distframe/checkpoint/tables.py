"""What a save makes of the file tables its ranks gather, before rank 0 commits it: checks that
the checkpoint about to be renamed into place is whole and readable, and the parts of the
metadata that come from every rank (each rank's optimizer param groups).

[Note: one directory for every rank]
Each rank names its temporary directory after its own ``path``, and rank 0 alone writes the
metadata and renames its directory into place. Ranks whose ``path`` is not rank 0's directory
(node-local disks, names that differ between ranks) wrote their shards where rank 0's checkpoint
will never hold them, yet every rank's save used to return, the previous checkpoint already
replaced by one no load can read. So rank 0 first checks that every rank's file, as its table
lists it, is in its directory with the size that rank wrote; the verdict goes through ``agree``,
so every rank raises, and each rank then removes its own temporary directory. The check is by
the files, not by comparing the paths: one directory may be spelled differently by each rank
(relative and absolute, or mounted at other places on other nodes).

[Note: every stage's param groups]
A pipeline's stages hold different parameters, and so their optimizers have different param
groups (layer-wise learning rates). The metadata used to hold rank 0's groups only: the other
stages' groups then named none of their parameters, and took rank 0's settings by position.
Every rank's groups go into the metadata now, in rank order: one entry per position and
settings, naming every parameter that groups of that position and settings trained on any rank
(the replicas of one stage have the same settings; under ZeRO each names its shard's
parameters). A load picks each group's settings by the parameters it trains
(``optimizers.sharded_state``); rank 0's groups come first,
so where it falls back to a group's position, that is rank 0's group at that position, as before
(and a checkpoint saved before this loads as it did). A parameter several stages hold (a tied
embedding) that their groups trained with different settings is refused at load, naming them.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from distframe.errors import ConfigError
from distframe.models.sharded_state import parse_piece_key
from distframe.optimizers.sharded_state import TRAINED

RANK_STATE = "rank_state"
_SHOWN = 3


def check_shared_directory(tmp: Path, tables: list[dict[str, Any]]) -> None:
    """ConfigError unless every rank's file is in ``tmp`` (rank 0's temporary directory) with
    the size its table gives: [Note: one directory for every rank]."""
    unseen = []
    for rank, table in enumerate(tables):
        try:
            size = (tmp / table["file"]).stat().st_size
        except FileNotFoundError:
            size = None
        if size != table["bytes"]:
            unseen.append(rank)
    if not unseen:
        return
    shown = dict.fromkeys([0, *unseen[:_SHOWN]])  # rank 0's path first, once
    where = ", ".join(f"rank {rank} to {tables[rank]['path']}" for rank in shown)
    raise ConfigError(
        f"ranks {unseen[:_SHOWN]}{'...' if len(unseen) > _SHOWN else ''} wrote their shard where "
        "rank 0 cannot see it: every rank must save to the same directory on a shared file system "
        f"(rank 0 saves {where.removeprefix('rank 0 ')}); pass every rank the same path")


def check_rank_state(tables: list[dict[str, Any]]) -> None:
    """ConfigError when ranks saved ``rank_state`` under one name: a load reads each by its name
    alone (``reader.whole("rank_state", name)``), and could read back neither."""
    savers: dict[str, list[int]] = {}
    for rank, table in enumerate(tables):
        for key in table["tensors"]:
            if key.startswith(f"{RANK_STATE}/"):
                savers.setdefault(parse_piece_key(key)[1], []).append(rank)
    shared = {name: ranks for name, ranks in sorted(savers.items()) if len(ranks) > 1}
    if shared:
        shown = "; ".join(f"ranks {ranks} each saved {name!r}"
                          for name, ranks in list(shared.items())[:_SHOWN])
        raise ConfigError(
            f"checkpoint.save: rank_state names must differ between ranks, but {shown}"
            f"{'; ...' if len(shared) > _SHOWN else ''}: put the rank in each name (e.g. f'rng-{{rank}}'), "
            "so that a load can tell them apart")


def merged_param_groups(tables: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's optimizer param groups (taken out of ``tables``), in rank order: one entry
    per position and settings, training the union of what the ranks' groups of that position
    and settings trained (ZeRO's ranks each list the parameters of their shard), so there are as
    many entries as there are distinct groups, not one per rank: [Note: every stage's param
    groups]."""
    merged: dict[tuple[int, str], dict[str, Any]] = {}
    for table in tables:
        for position, group in enumerate(table.pop("param_groups", None) or []):
            settings = {k: v for k, v in group.items() if k != TRAINED}
            entry = merged.setdefault((position, json.dumps(settings, sort_keys=True)), settings)
            if TRAINED in group:
                entry[TRAINED] = sorted(set(entry.get(TRAINED, ())) | set(group[TRAINED]))
    return list(merged.values())


def remove(entry: Path) -> None:
    """Removes ``entry``: a symbolic link itself (not what it points to), else a directory's
    tree (rmtree refuses a link, and ``ignore_errors`` hid that: the link stayed for good)."""
    if entry.is_symlink():
        entry.unlink(missing_ok=True)
    else:
        shutil.rmtree(entry, ignore_errors=True)
