"""What ``distframe train`` writes in ``--out`` and what a fresh run there may replace.

A run writes ``config.json``, ``metrics.jsonl``, ``loss.png`` and ``checkpoints/step-N`` (the
sharded format: ``metadata.json`` and shard files, saved through temporary ``.step-N.tmp-*``
directories, with ``.step-N.old-*`` left by a save that died between its renames). A fresh run
in an OUT that holds an earlier distframe run (its ``config.json`` is distframe's) replaces that
run's metrics and checkpoints and nothing else: another tool's files under ``OUT/checkpoints``
stay. An OUT whose run files are not provably distframe's (no config.json, or another tool's) is
refused with one line: deleting or overwriting what distframe did not write would lose it silently.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from distframe.errors import ConfigError

RUN_FILES = ("config.json", "metrics.jsonl", "loss.png")
CHECKPOINTS = "checkpoints"
# The entries of OUT/checkpoints that a distframe save makes: checkpoints, a save's temporary
# directory (12 hex digits, checkpoint.temporary) and a checkpoint a save moved aside.
_OWN_ENTRY = re.compile(r"step-\d+|\.step-\d+\.(tmp-[0-9a-f]{12}|old-.+)")
_SAVED_FILE = re.compile(r"metadata\.json|shard-\d+-of-\d+\.safetensors|writer-\d+\.json")


def cannot_write(out: str, path: str, exc: OSError) -> ConfigError:
    """The one-line error for an OSError writing ``path`` under OUT (a full disk, a directory
    where the file goes, no permission)."""
    return ConfigError(f"--out {out}: cannot write {path} ({exc.strerror or exc}); free space or fix "
                       f"that path (a directory or file in the way), or pass another --out")


def check_out_writable(out: str) -> None:
    """ConfigError naming ``--out`` unless this process can create OUT and OUT/checkpoints and
    write files there, and each of OUT's run files is absent or a file (checked before the ranks
    train: a rank that cannot write its first checkpoint or metrics record would fail with an
    OSError's traceback after the run's first interval, or mid-run)."""
    checkpoints = os.path.join(out, CHECKPOINTS)
    for name in RUN_FILES:
        path = os.path.join(out, name)
        if os.path.isdir(path):
            raise ConfigError(f"--out {out}: {path} is a directory, where the run writes its {name}; "
                              "move it away or pass another --out")
    if os.path.exists(checkpoints) and not os.path.isdir(checkpoints):
        raise ConfigError(f"--out {out}: {checkpoints} is a file, where the run writes its checkpoints; "
                          "move it away or pass another --out")
    for directory in (out, checkpoints):
        try:
            os.makedirs(directory, exist_ok=True)
            handle, probe = tempfile.mkstemp(dir=directory, prefix=".distframe-write-check-")
            os.close(handle)
            os.remove(probe)
        except OSError as exc:
            raise ConfigError(f"--out {out}: cannot write there ({exc.strerror or exc}); pass a "
                              "directory you can write to") from None


def is_distframe_config(path: str) -> bool:
    """Whether ``path`` is a config.json that distframe train wrote: a JSON object holding the
    "train" settings and the "model" shape (``train_loop.run_info``)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and isinstance(raw.get("train"), dict) and isinstance(raw.get("model"), dict)


def foreign_entries(out: str) -> list[str]:
    """What in OUT a fresh run would overwrite or delete although it cannot tell distframe wrote
    it: every run file and every entry of OUT/checkpoints, unless OUT/config.json is distframe's
    (then nothing: an earlier run's own files are replaced, another tool's are left alone)."""
    if is_distframe_config(os.path.join(out, "config.json")):
        return []
    found = [name for name in RUN_FILES if os.path.lexists(os.path.join(out, name))]
    checkpoints = os.path.join(out, CHECKPOINTS)
    if os.path.isdir(checkpoints):
        found += sorted(f"{CHECKPOINTS}/{name}" for name in os.listdir(checkpoints)
                        if not name.startswith(".distframe-write-check-"))
    elif os.path.lexists(checkpoints):
        found.append(CHECKPOINTS)
    return found


def check_fresh_out(out: str) -> None:
    """ConfigError, naming what is there, when a fresh run (no --resume) in ``out`` would
    overwrite or delete files that are not an earlier distframe run's."""
    found = foreign_entries(out)
    if not found:
        return
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    config = os.path.join(out, "config.json")
    why = ("its config.json is not one distframe train wrote" if os.path.lexists(config)
           else "it has no config.json of a distframe run")
    raise ConfigError(f"--out {out} holds {shown}, and {why}, so a new run there would overwrite or "
                      f"delete them; pass another --out, or remove them (--resume continues a "
                      "distframe run)")


def remove_earlier_checkpoints(out: str) -> list[str]:
    """Deletes an earlier distframe run's checkpoints under OUT/checkpoints (``step-N`` and a
    save's leftovers, each holding only what a save writes); returns the names of the entries
    left there (another tool's, or a directory holding other files as well)."""
    checkpoints = Path(out, CHECKPOINTS)
    if not checkpoints.is_dir():
        return []
    kept = []
    for entry in sorted(checkpoints.iterdir()):
        if entry.name.startswith(".distframe-write-check-"):
            continue
        if _OWN_ENTRY.fullmatch(entry.name) and _written_by_a_save(entry):
            shutil.rmtree(entry)
        else:
            kept.append(entry.name)
    return kept


def _written_by_a_save(entry: Path) -> bool:
    """A directory (not a link) holding only a save's files; a ``step-N`` also its metadata.json
    (a step-N without one is not a checkpoint distframe completed: not provably its own)."""
    if entry.is_symlink() or not entry.is_dir():
        return False
    names = [p.name for p in entry.iterdir()]
    own = all(_SAVED_FILE.fullmatch(n) and (entry / n).is_file() for n in names)
    return own and (entry.name.startswith(".") or "metadata.json" in names)
