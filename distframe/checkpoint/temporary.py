"""The temporary directories saves write into (``.NAME.tmp-<token>``), who writes each, and the
removal of those whose save died.

[Note: which temporary directories a save removes]
Every rank of a save writes ``writer-<rank>.json`` into the save's temporary directory right
after making it, before its shard: its machine (host name, Linux boot id and pid namespace), pid
and the process's start time (``/proc/<pid>/stat``, clock ticks since boot). The records go into
place with the directory and are deleted from the checkpoint at once (``drop_writer_records``).
A save killed midway leaves its directory behind; rank 0 of every later save that completes, in
the same parent directory, whatever its checkpoint's name, removes each ``.*.tmp-<token>``
directory there (``remove_abandoned``; the token is 12 hex digits) that holds nothing but what a
save writes (shard files, writer records, metadata.json) and whose every writer is provably gone:

* a writer on this machine is gone when its pid is not alive (or a zombie), or is now another
  process's (that process started at another time);
* a writer on another machine (other host name, boot id or pid namespace: its pid says nothing
  here) counts as gone only once nothing in the directory has changed for FOREIGN_WRITER_AGE_S
  (a day: saves take minutes, and clocks on a shared file system may differ);
* a directory without records (from a distframe before them, or a writer between its mkdir and
  its record) or with a record that cannot be read is judged by that same age alone.

So the directory of a save that another process (rank, job, host) is still writing stays, and so
does one this process abandoned while it lives (a save interrupted in a notebook). Nothing else
is touched: not checkpoints, not ``.NAME.old-*`` (a checkpoint a save moved aside; see io), not
another tool's directory whose name merely looks like a save's (it holds other files).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from distframe.checkpoint.format import METADATA, SHARD_FILE

FOREIGN_WRITER_AGE_S = 24 * 3600
WRITER_RECORD = re.compile(r"writer-\d+\.json")
_TEMPORARY = re.compile(r"\..+\.tmp-[0-9a-f]{12}")


def temporary_name(name: str, token: str) -> str:
    """The save's temporary directory's name; ``token``: 12 hex digits (io._agree_token), as
    ``remove_abandoned`` expects."""
    return f".{name}.tmp-{token}"


def write_writer_record(tmp: Path, rank: int) -> None:
    """``tmp/writer-<rank>.json``: this process, as the writer of rank ``rank``'s part."""
    record = {**_machine(), "pid": os.getpid(), "start_time": _start_time(os.getpid()), "rank": rank}
    (tmp / f"writer-{rank:05d}.json").write_text(json.dumps(record))


def drop_writer_records(checkpoint: Path) -> None:
    for entry in checkpoint.iterdir():
        if WRITER_RECORD.fullmatch(entry.name):
            entry.unlink(missing_ok=True)


def remove_abandoned(directory: Path) -> None:
    """Removes every temporary directory in ``directory`` whose save died (see the note above);
    one that another process removes or renames meanwhile is left to it."""
    for entry in list(directory.iterdir()):
        if not _TEMPORARY.fullmatch(entry.name):
            continue
        try:
            abandoned = entry.is_dir() and _abandoned(entry)
        except OSError:  # gone or renamed under us: not ours to judge
            continue
        if abandoned:
            shutil.rmtree(entry, ignore_errors=True)


def _abandoned(tmp: Path) -> bool:
    entries = list(tmp.iterdir())
    if not all(_written_by_a_save(e) for e in entries):  # another tool's: not ours to remove
        return False
    newest = max([tmp.stat().st_mtime] + [e.stat().st_mtime for e in entries])
    old = time.time() - newest > FOREIGN_WRITER_AGE_S
    records = [e for e in entries if WRITER_RECORD.fullmatch(e.name)]
    if not records:
        return old
    here = _machine()
    for path in records:
        record = _read_record(path)
        if record is None or any(record.get(k) != v for k, v in here.items()):
            if not old:  # unreadable, or another machine's writer: only its age tells
                return False
        elif _alive(record["pid"], record.get("start_time")):
            return False
    return True


def _written_by_a_save(entry: Path) -> bool:
    name = entry.name
    return (entry.is_file() and not entry.is_symlink()
            and (name == METADATA or SHARD_FILE.fullmatch(name) or WRITER_RECORD.fullmatch(name)) is not None)


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):  # a writer killed while writing it, or gone meanwhile
        return None
    if not isinstance(record, dict) or type(record.get("pid")) is not int:
        return None
    return record


def _machine() -> dict[str, str | None]:
    """What tells this machine's processes from others': a pid means the same process only
    under the same host name, boot and pid namespace (containers on one host share the boot)."""
    return {"host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id"),
            "pid_namespace": _link("/proc/self/ns/pid")}


def _alive(pid: int, start_time: int | None) -> bool:
    """Whether process ``pid`` of this machine is running and is the one that started at
    ``start_time`` (None: unknown, e.g. not Linux, and then any process with that pid counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    stat = _stat_fields(pid)
    if stat is not None and stat[0] in ("Z", "X"):  # killed, not yet reaped: writes nothing
        return False
    return start_time is None or stat is None or int(stat[19]) == start_time


def _start_time(pid: int) -> int | None:
    stat = _stat_fields(pid)
    return None if stat is None else int(stat[19])


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from its third field (state) on; the name before may hold spaces."""
    text = _read(f"/proc/{pid}/stat")
    return None if text is None else text.rsplit(")", 1)[-1].split()


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None
