"""``rank_state`` holds each rank's own tensors, read back by name: a name that two ranks save
could not be read back by either, so save refuses it, on every rank, before committing."""
import torch
from torch import nn

from distframe import checkpoint
from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import DDPModel
from tests.models.common import SEED_LOCK


def _model(backend):
    with SEED_LOCK:
        torch.manual_seed(0)
        module = nn.Linear(4, 4).double()
    return DDPModel(module, backend)


def test_a_rank_state_name_saved_by_two_ranks_is_refused(tmp_path):
    # It saved, and every later load failed: KeyError "no single stored rank_state piece for 'rng'".
    spawn(lambda b: checkpoint.save(tmp_path / "ckpt", _model(b), step=1), 3, timeout=30)
    before = sorted(p.name for p in tmp_path.rglob("*"))

    def save(backend):
        names = {0: ["rng", "own-0"], 1: ["rng", "own-1"], 2: ["own-2"]}[backend.rank]
        try:
            checkpoint.save(tmp_path / "ckpt", _model(backend), step=2,
                            rank_state={name: torch.zeros(3) for name in names})
        except ConfigError as exc:
            return str(exc)
        return None
    for message in spawn(save, 3, timeout=30):
        assert message is not None, "the save returned normally"
        assert "ranks [0, 1] each saved 'rng'" in message and "own-" not in message, message
        assert "names must differ between ranks" in message, message
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert checkpoint.consolidate(tmp_path / "ckpt")  # the previous checkpoint loads


def test_rank_state_names_of_each_rank_load_back(tmp_path):
    def save(backend):
        checkpoint.save(tmp_path / "ckpt", _model(backend), step=1,
                        rank_state={f"rng-{backend.rank}": torch.full((2,), float(backend.rank))})

    def load(backend):
        got = {}
        checkpoint.load(tmp_path / "ckpt", _model(backend), read_rank_state=lambda meta, reader: got.update(
            value=reader.whole("rank_state", f"rng-{backend.rank}")))
        return got["value"].tolist()
    spawn(save, 2, timeout=30)
    assert spawn(load, 2, timeout=30) == [[0.0, 0.0], [1.0, 1.0]]
