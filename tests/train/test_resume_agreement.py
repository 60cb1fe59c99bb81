"""``--resume`` under a launcher: each process sees its own file system (node-local disks), so
the ranks agree on the checkpoint and on whether --steps is reachable, or all stop with one line."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distframe import spawn, train_checkpoint
from distframe.errors import ConfigError
from tests.train.conftest import TINY, train
from tests.train.test_launchers import _mpiexec


@pytest.fixture(scope="module")
def node_local_runs(tmp_path_factory, corpus_file) -> Path:
    """``node0/run`` holds checkpoints step-1 and step-2, ``node1/run`` only step-1: the same run
    as two nodes' disks see it when one node missed the last checkpoint."""
    root = tmp_path_factory.mktemp("nodes")
    train(root / "run", corpus_file, "--steps", "2", "--world-size", "1", "--checkpoint-every", "1",
          "--eval-batches", "1")
    for node in ("node0", "node1"):
        shutil.copytree(root / "run", root / node / "run")
    shutil.rmtree(root / "node1" / "run" / "checkpoints" / "step-2")
    return root


def _verdict(out_dirs: list[Path], steps: int) -> list[object]:
    """Each in-memory rank's agreed_resume_step in its own directory (its message with that
    directory written OUT, as the ranks of a launcher share one --out string)."""
    def rank(backend):
        out = str(out_dirs[backend.rank])
        try:
            return train_checkpoint.agreed_resume_step(out, steps, backend)
        except ConfigError as exc:
            return f"ConfigError: {exc}".replace(out, "OUT")
    return spawn(rank, len(out_dirs))


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_ranks_that_see_different_checkpoints_all_stop(node_local_runs, steps):
    """Rank 0 sees step 2, rank 1 step 1: whatever --steps, both raise the same ConfigError (it
    was CheckpointError, or with --steps 2 rank 0 ended with nothing to train while rank 1
    trained on alone)."""
    verdicts = _verdict([node_local_runs / "node0" / "run", node_local_runs / "node1" / "run"], steps)
    assert verdicts[0] == verdicts[1]
    assert verdicts[0].startswith("ConfigError: --resume: the ranks see different latest checkpoints")
    assert "step 2 on rank 0; step 1 on rank 1" in verdicts[0]


def test_ranks_that_agree(node_local_runs):
    run = node_local_runs / "node0" / "run"
    assert _verdict([run, run], 2) == [2, 2]
    assert _verdict([run, run], 5) == [2, 2]
    below = _verdict([run, run], 1)
    assert below[0] == below[1] and "--steps 1" in below[0] and "above 2" in below[0]
    empty = _verdict([node_local_runs / "nowhere", run], 5)
    assert empty[0] == empty[1] and "none on rank 0" in empty[0]


@pytest.mark.mpi
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or _mpiexec() is None,
                    reason="needs mpi4py and mpiexec (pip install 'distframe[mpi]')")
def test_under_mpiexec_with_node_local_checkpoints(node_local_runs, corpus_file):
    """Each mpiexec rank runs in its own node's directory: every rank stops with status 2 and
    rank 0 alone prints one line (before, with --steps 2, rank 0 exited 0 at once and rank 1
    waited for it in the collectives until the timeout)."""
    per_node = 'cd "$0/node${PMI_RANK:-$OMPI_COMM_WORLD_RANK}" && exec "$@"'
    command = [_mpiexec(), "-n", "2", "sh", "-c", per_node, str(node_local_runs), sys.executable,
               "-m", "distframe", "train", "--backend", "mpi", *TINY, "--data", corpus_file,
               "--out", "run", "--resume", "--steps", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "different latest checkpoints" in lines[0] and "step 1 on rank 1" in lines[0]
    assert sorted(p.name for p in (node_local_runs / "node1" / "run" / "checkpoints").iterdir()) == [
        "step-1"]


def test_a_finished_run_damaged_on_one_node_stops_every_rank(node_local_runs, tmp_path):
    """--resume --steps 2 where node 1's copy of step-2 is damaged: both ranks raise the same
    error, naming the damage (before, rank 0 ended with "already reached step 2")."""
    from types import SimpleNamespace

    from distframe import train
    from distframe.checkpoint.format import CheckpointError
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for node in dirs:
        shutil.copytree(node_local_runs / "node0" / "run", node)
    shard = sorted((dirs[1] / "checkpoints" / "step-2").glob("shard-*"))[0]
    shard.write_bytes(shard.read_bytes()[:-8])

    def rank(backend):
        config = SimpleNamespace(out=str(dirs[backend.rank]), steps=2)
        try:
            return train._already_finished(config, rank=backend.rank, backend=backend)
        except CheckpointError as exc:
            return str(exc).replace(str(dirs[1]), "OUT")
    verdicts = spawn(rank, 2)
    assert verdicts[0] == verdicts[1], verdicts
    assert "rank 1 of 2" in verdicts[0] and "step-2 is damaged" in verdicts[0]
    intact = spawn(lambda backend: train._already_finished(
        SimpleNamespace(out=str(dirs[0]), steps=2), rank=backend.rank, backend=backend), 2)
    assert [r.already_finished for r in intact] == [True, True]
