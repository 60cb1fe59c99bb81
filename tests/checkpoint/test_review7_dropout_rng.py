"""The dropout generators of a model-parallel model with tp 1 (``dropout_seed``) in checkpoints,
when world rank 0's stage has no active dropout: rank 0 alone wrote the metadata, recorded no
generator layout since it held no generators, and the later stages' generators, though written,
were never restored (a resumed run drew other masks) nor refused under another layout."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe import checkpoint
from distframe.checkpoint import CheckpointError
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models import PipelineParallelModel
from distframe.models.hybrid import HybridShardedModel
from tests.models.common import SEED_LOCK

STAGE1_ONLY = {"dp": 1, "tp": 1, "pp": 2, "cp": 1}


def _sequential(stage0_dropout: float) -> nn.Sequential:
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.Dropout(stage0_dropout), nn.GELU(), nn.Linear(16, 16),
                             nn.Dropout(0.5), nn.Linear(16, 3)).double()


def _batches() -> list:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g))
            for _ in range(4)]


def _build(backend, kind: str, stage0_dropout: float = 0.0, seed: int = 7):
    if kind == "pipeline":
        return PipelineParallelModel(_sequential(stage0_dropout), backend, num_microbatches=2,
                                     split_points=[3], dropout_seed=seed)
    dims = {"hybrid": ParallelDims(dp=2, tp=1, pp=2), "data_parallel": ParallelDims(dp=2, tp=1, pp=1)}[kind]
    return HybridShardedModel(_sequential(stage0_dropout), backend, dims=dims, num_microbatches=2,
                              split_points=[3] if dims.pp > 1 else None, dropout_seed=seed)


def _run(backend, kind, steps, *, seed=7, load_from=None, save_to=None, stage0_dropout=0.0):
    """SGD steps ``steps`` (indices into ``_batches()``) on this rank's data-parallel slice."""
    model = _build(backend, kind, stage0_dropout, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if load_from is not None:
        checkpoint.load(load_from, model, opt)
    dp, index = model.dims.dp, model.groups.dp_index
    per = 8 // dp
    losses = [model.train_step((x[index * per:(index + 1) * per], y[index * per:(index + 1) * per]),
                               F.cross_entropy, opt) for x, y in (_batches()[s] for s in steps)]
    if save_to is not None:
        checkpoint.save(save_to, model, opt, step=steps[-1] + 1)
    return losses


@pytest.mark.parametrize("kind,world", [("pipeline", 2), ("hybrid", 4)])
def test_a_resumed_run_draws_the_masks_of_the_uninterrupted_run(tmp_path, kind, world):
    whole = spawn(lambda b: _run(b, kind, [0, 1, 2, 3]), world, timeout=60)
    spawn(lambda b: _run(b, kind, [0, 1], save_to=tmp_path / "ck"), world, timeout=60)
    # Another seed: what the resumed run draws must come from the checkpoint. Bitwise: the same
    # float64 operations in the same order on the same values.
    resumed = spawn(lambda b: _run(b, kind, [2, 3], seed=99, load_from=tmp_path / "ck"), world, timeout=60)
    for losses, resumed_losses in zip(whole, resumed):
        assert resumed_losses == losses[2:]
    meta = json.loads((tmp_path / "ck" / "metadata.json").read_text())
    assert meta["dropout_rng"] == {**STAGE1_ONLY, "dp": world // 2}


def test_a_load_under_another_layout_is_refused_by_name(tmp_path):
    spawn(lambda b: _run(b, "pipeline", [0], save_to=tmp_path / "ck"), 2, timeout=60)

    def load(backend):
        try:
            _run(backend, "data_parallel", [], load_from=tmp_path / "ck")
        except CheckpointError as exc:
            return str(exc)
        return None
    for message in spawn(load, 2, timeout=60):
        assert message is not None and "dp=1 tp=1 pp=2 cp=1" in message, message
        assert "dp=2 tp=1 pp=1 cp=1" in message and "restore_dropout_rng=False" in message, message


def test_a_stage_saved_without_active_dropout_loads_into_one_with_it(tmp_path):
    # Its rank saved no generators (it had none, and drew nothing): loaded into a model whose
    # stage 0 drops, that rank's generators start from the seed; the checkpoint is not incomplete.
    spawn(lambda b: _run(b, "pipeline", [0, 1], save_to=tmp_path / "ck"), 2, timeout=60)
    resumed = spawn(lambda b: _run(b, "pipeline", [2, 3], load_from=tmp_path / "ck", stage0_dropout=0.3),
                    2, timeout=60)
    assert resumed[0] == resumed[1] and len(resumed[0]) == 2


def test_ranks_with_and_without_generators_agree_on_the_layout():
    from distframe.checkpoint import dropout_rng
    tables = [{"dropout_rng": None}, {"dropout_rng": dict(STAGE1_ONLY)}, {"dropout_rng": dict(STAGE1_ONLY)}]
    assert dropout_rng.agreed_layout(tables) == STAGE1_ONLY
    assert all("dropout_rng" not in table for table in tables)  # not left in the metadata's file tables
    assert dropout_rng.agreed_layout([{"dropout_rng": None}, {}]) is None
