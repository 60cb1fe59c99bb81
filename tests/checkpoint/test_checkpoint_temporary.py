"""The temporary directories of saves that died (``.NAME.tmp-*``) are removed by a later save in
the same directory, whatever name it saves under; those of saves still being written, by another
process of this machine or (until they are a day old) by any process of another, stay."""
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from distframe import checkpoint
from distframe.checkpoint import temporary
from distframe.launch import spawn
from tests.models.common import STRATEGIES, build_model

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def save_in_progress(path: Path):
    """A process saving a checkpoint at ``path``, stopped inside the write of its shard; yields
    the process and the save's temporary directory; kills the process at the end."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-m", "tests.checkpoint.save_until_killed", str(path)],
                               cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = process.stdout.readline()  # b"" if it ended without reaching the write
        assert line == b"writing\n", process.communicate()[1].decode()[-2000:]
        (tmp,) = path.parent.glob(f".{path.name}.tmp-*")
        yield process, tmp
    finally:
        process.kill()
        process.wait()


def _save(path: Path) -> None:
    spawn(lambda b: checkpoint.save(path, STRATEGIES["ddp"][0](build_model(seed=2), b), step=2), 2)


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _age(tmp: Path, seconds: float) -> None:
    """Makes ``tmp`` and what it holds look last written ``seconds`` ago."""
    when = time.time() - seconds
    for entry in [*tmp.iterdir(), tmp]:
        os.utime(entry, (when, when))


def _edit_records(tmp: Path, **fields) -> None:
    for record in tmp.glob("writer-*.json"):
        record.write_text(json.dumps({**json.loads(record.read_text()), **fields}))


def test_a_save_killed_midway_is_cleaned_up_by_a_later_save_of_another_name(tmp_path):
    # With step-numbered names no later save has the killed one's name: its directory (and the
    # partial shard in it) stayed for good.
    with save_in_progress(tmp_path / "ckpt-100") as (process, tmp):
        process.kill()
        process.wait()
    assert (tmp / "shard-00000-of-00001.safetensors").stat().st_size == 64
    _save(tmp_path / "ckpt-200")
    assert _names(tmp_path) == ["ckpt-200"]
    checkpoint.consolidate(tmp_path / "ckpt-200")


@pytest.mark.parametrize("same_name", [False, True])
def test_the_directory_of_a_save_still_being_written_stays(tmp_path, same_name):
    # Another job (or rank) saving into the same directory: a later save of the same name used
    # to delete its temporary directory under it.
    with save_in_progress(tmp_path / "ckpt-100") as (process, tmp):
        other = tmp_path / ("ckpt-100" if same_name else "ckpt-200")
        _save(other)
        assert process.poll() is None and tmp.is_dir()
        assert (tmp / "shard-00000-of-00001.safetensors").stat().st_size == 64
        assert _names(tmp_path) == sorted([other.name, tmp.name])
    _save(tmp_path / "ckpt-300")  # and once it has died, the next save removes it
    assert _names(tmp_path) == sorted({other.name, "ckpt-300"})


def test_a_writer_on_another_machine_is_given_a_day(tmp_path):
    with save_in_progress(tmp_path / "ckpt-100") as (process, tmp):
        process.kill()
        process.wait()
    _edit_records(tmp, host="another-host")  # its pid says nothing here
    _save(tmp_path / "ckpt-200")
    assert tmp.is_dir()
    _age(tmp, temporary.FOREIGN_WRITER_AGE_S - 3600)
    _save(tmp_path / "ckpt-300")
    assert tmp.is_dir()
    _age(tmp, temporary.FOREIGN_WRITER_AGE_S + 3600)
    _save(tmp_path / "ckpt-400")
    assert _names(tmp_path) == ["ckpt-200", "ckpt-300", "ckpt-400"]


def test_a_pid_now_used_by_another_process_does_not_keep_a_directory(tmp_path):
    with save_in_progress(tmp_path / "ckpt-100") as (process, tmp):
        process.kill()
        process.wait()
    # The killed writer's pid, now this test process's (a live pid), started at another time.
    _edit_records(tmp, pid=os.getpid())
    _save(tmp_path / "ckpt-200")
    assert _names(tmp_path) == ["ckpt-200"]


def test_a_directory_without_writer_records_is_removed_only_when_old(tmp_path):
    # Left by a distframe before writer records: no way to tell whether its writer is alive.
    tmp = tmp_path / ".ckpt-100.tmp-00000000abcd"
    tmp.mkdir()
    (tmp / "shard-00000-of-00001.safetensors").write_bytes(b"\0" * 64)
    _save(tmp_path / "ckpt-200")
    assert tmp.is_dir()
    _age(tmp, temporary.FOREIGN_WRITER_AGE_S + 3600)
    _save(tmp_path / "ckpt-300")
    assert _names(tmp_path) == ["ckpt-200", "ckpt-300"]


def test_a_complete_checkpoint_holds_no_writer_records(tmp_path):
    _save(tmp_path / "ckpt")
    assert _names(tmp_path / "ckpt") == ["metadata.json", "shard-00000-of-00002.safetensors",
                                         "shard-00001-of-00002.safetensors"]
    _save(tmp_path / "ckpt")  # over it
    assert _names(tmp_path) == ["ckpt"]


@pytest.mark.parametrize("name,content", [
    (".cache.tmp-abc", {"notes.txt": b"mine"}),
    (".x.tmp-00000000abcd", {"data.bin": b"\0" * 8}),
    (".x.tmp-00000000abcd", {"sub/shard-00000-of-00001.safetensors": b""}),
])
def test_an_old_directory_that_is_not_a_saves_is_left_alone(tmp_path, name, content):
    # Another tool's dot-directory whose name happens to end in .tmp-<hex>: a save removed it,
    # with what it held, once a day old, taking it for one of its own without writer records.
    other = tmp_path / name
    for relative, data in content.items():
        (other / relative).parent.mkdir(parents=True, exist_ok=True)
        (other / relative).write_bytes(data)
    _age(other, temporary.FOREIGN_WRITER_AGE_S + 3600)
    _save(tmp_path / "ckpt")
    assert _names(tmp_path) == sorted(["ckpt", name])
    for relative, data in content.items():
        assert (other / relative).read_bytes() == data


def test_a_save_leaves_pythons_random_stream_alone(tmp_path):
    # The temporary directory's token came from random.getrandbits on rank 0 only: a save moved
    # rank 0's stream out of step with the others' (and of a run without the save), and after
    # random.seed the token, so the temporary directory, repeated from run to run.
    import random

    def run(backend, save):
        model = STRATEGIES["ddp"][0](build_model(), backend)
        random.seed(1234)
        if save:
            checkpoint.save(tmp_path / f"ckpt-{save}", model, step=0)
        return random.random()

    # One rank: in-memory ranks are threads, which share Python's random module.
    assert spawn(lambda b: run(b, "a"), 1) == spawn(lambda b: run(b, None), 1)
