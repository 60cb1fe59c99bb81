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
