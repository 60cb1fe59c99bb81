"""A load checks each shard file's sha256 on the ranks that read from it, not every file on every
rank: with sharded state a rank hashes its own shard, so a load costs one pass over the
checkpoint in all rather than one per rank. A corrupt file is still refused on every rank."""
import threading
from pathlib import Path

import pytest
import torch

from distframe import checkpoint
from distframe.checkpoint import CheckpointError
from distframe.checkpoint import format as checkpoint_format
from distframe.launch import spawn
from tests.checkpoint.test_checkpoint_failures import _outcome, _save
from tests.models.common import STRATEGIES, build_model

SHARDS = [f"shard-0000{r}-of-00002.safetensors" for r in range(2)]


def _load(backend, path, strategy):
    model = STRATEGIES[strategy][0](build_model(seed=5), backend)
    opt = STRATEGIES[strategy][1](model, torch.optim.Adam, lr=1e-2)
    return _outcome(backend, lambda: checkpoint.load(path, model, opt))


def _hashed_by_rank(monkeypatch, strategy, path):
    """The shard files each rank hashed while loading ``path``."""
    hashed: dict[int, list[str]] = {}
    real = checkpoint_format.sha256_of

    def recording(file):
        hashed.setdefault(threading.get_ident(), []).append(Path(file).name)
        return real(file)

    monkeypatch.setattr(checkpoint_format, "sha256_of", recording)

    def load(backend):
        assert _load(backend, path, strategy) == (None, 2)
        return sorted(hashed.get(threading.get_ident(), []))
    return spawn(load, 2)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_each_rank_hashes_only_the_shard_it_reads(tmp_path, monkeypatch, strategy):
    spawn(lambda b: _save(b, tmp_path / "ckpt", strategy), 2)
    assert _hashed_by_rank(monkeypatch, strategy, tmp_path / "ckpt") == [[SHARDS[0]], [SHARDS[1]]]


def test_replicated_state_is_read_and_hashed_from_every_file(tmp_path, monkeypatch):
    # DDP's ranks each read the whole model, which the save split over both files.
    spawn(lambda b: _save(b, tmp_path / "ckpt", "ddp"), 2)
    assert _hashed_by_rank(monkeypatch, "ddp", tmp_path / "ckpt") == [SHARDS, SHARDS]


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_a_corrupt_shard_only_one_rank_reads_is_refused_on_every_rank(tmp_path, strategy):
    path = tmp_path / "ckpt"
    spawn(lambda b: _save(b, path, strategy), 2)
    data = bytearray((path / SHARDS[1]).read_bytes())
    data[-3] ^= 0xFF  # same size: only the checksum can tell
    (path / SHARDS[1]).write_bytes(bytes(data))
    for (kind, message), together in spawn(lambda b: _load(b, path, strategy), 2, timeout=20):
        assert together == 2 and kind is CheckpointError
        assert "failed on rank 1 of 2" in message and "sha256" in message and SHARDS[1] in message
