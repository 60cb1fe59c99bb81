"""Buffers under HybridShardedModel with data parallelism: as with DDPModel (and torch DDP), data-
parallel replica 0's buffers (BatchNorm running statistics) reach the other replicas of the same
stage before each synchronising forward and in gather_full_parameters, the same on every rank."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models.hybrid import HybridShardedModel
from tests.models.common import SEED_LOCK

STEPS = 3


def batch_norm_model() -> nn.Sequential:
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8),
                             nn.BatchNorm1d(8), nn.Linear(8, 2)).double()


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_follow_data_parallel_replica_0(pp, broadcast):
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 4, generator=g, dtype=torch.float64),
                torch.randn(8, 2, generator=g, dtype=torch.float64)) for _ in range(STEPS)]

    def run(backend):
        model = HybridShardedModel(batch_norm_model(), backend, dims=ParallelDims(dp=2, pp=pp),
                                   num_microbatches=2, broadcast_buffers=broadcast)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        index = model.groups.dp_index
        for x, y in batches:
            model.train_step((x[index * 4:(index + 1) * 4], y[index * 4:(index + 1) * 4]), F.mse_loss, opt)
        own = {n: b.clone() for n, b in model.local_buffers.items()}
        return index, own, model.gather_full_parameters()
    results = spawn(run, 2 * pp, timeout=30)
    names = [n for n in results[0][2] if "running_mean" in n]
    assert len(names) == 2
    for name in names:
        values = [full[name] for _, _, full in results]
        if broadcast:
            for value in values[1:]:
                torch.testing.assert_close(value, values[0], rtol=0, atol=0)
        else:  # each replica keeps its own: the two halves of the batch give different statistics
            replica_1 = [full[name] for index, _, full in results if index == 1]
            assert not torch.equal(replica_1[0], values[0])
    if broadcast:  # replica 0's own statistics, not an average or replica 1's
        for index, own, full in results:
            for name, value in own.items():
                if index == 0:
                    torch.testing.assert_close(full[name], value, rtol=0, atol=0)


def test_pipeline_with_buffers_on_every_stage_round_trips_a_checkpoint(tmp_path):
    # Each stage stores its own buffers; the metadata once listed only rank 0's (stage 0's), so
    # loading failed on the later stages ('4.running_mean' is not in the checkpoint).
    from distframe import checkpoint

    def run(backend):
        model = HybridShardedModel(batch_norm_model(), backend, dims=ParallelDims(pp=2),
                                   num_microbatches=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        model.train_step((x, x[:, :2]), F.mse_loss, opt)
        checkpoint.save(tmp_path / "ckpt", model, step=1)
        saved = model.gather_full_parameters()
        fresh = HybridShardedModel(batch_norm_model(), backend, dims=ParallelDims(pp=2),
                                   num_microbatches=2)
        checkpoint.load(tmp_path / "ckpt", fresh)
        return saved, fresh.gather_full_parameters()
    for saved, loaded in spawn(run, 2, timeout=30):
        assert saved.keys() == loaded.keys() and "4.running_mean" in saved
        for name, value in saved.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
    consolidated = checkpoint.consolidate(tmp_path / "ckpt")
    assert "4.running_mean" in consolidated and "1.num_batches_tracked" in consolidated


def test_consolidate_names_a_tied_weight_under_every_name_when_pipelined(tmp_path):
    from distframe import checkpoint
    from tests.models.common import tiny_lm

    def run(backend):
        model = HybridShardedModel(tiny_lm(), backend, dims=ParallelDims(pp=2), num_microbatches=2)
        checkpoint.save(tmp_path / "lm", model, step=0)
    spawn(run, 2, timeout=30)
    dense = tiny_lm().state_dict()
    consolidated = checkpoint.consolidate(tmp_path / "lm")
    assert consolidated.keys() == dense.keys()
    for name, value in dense.items():
        torch.testing.assert_close(consolidated[name], value, rtol=0, atol=0, msg=name)


def test_a_buffer_of_another_shape_is_refused_before_anything_changes():
    # copy_ would broadcast a stored (1,) buffer into a (8,) one silently; DDPModel already
    # refused it, the model-parallel strategies now share its check.
    from distframe.errors import ConfigError

    def run(backend):
        model = HybridShardedModel(batch_norm_model(), backend, dims=ParallelDims(pp=2), num_microbatches=2)
        state = model.state_dict()  # this stage's parameters and buffers: all that it reads
        before = model.gather_full_parameters()
        bad = {k: (v[:1] if k.endswith("running_mean") else v) for k, v in state.items()}
        with pytest.raises(ConfigError, match="running_mean"):
            model.load_state_dict(bad)
        after = model.gather_full_parameters()
        for name, value in before.items():
            torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=name)
    spawn(run, 2, timeout=30)
