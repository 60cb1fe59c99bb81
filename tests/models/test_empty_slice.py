"""A rank whose slice of the global batch is empty (a global batch of 1 over 2 data-parallel ranks):
its mean loss is 0/0, and the others' gradients were averaged with its zeros, so train_step returned
NaN and took half the step one process takes, with no error. Refused on that rank, every strategy."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models.ddp import DDPModel
from distframe.models.hybrid import HybridShardedModel
from distframe.models.pipeline import PipelineParallelModel
from distframe.models.zero import ZeRO2Model
from distframe.optimizers import ZeRO2Optimizer


def _step(b, strategy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    rows = 1 - b.rank % 2  # ranks 1 (and 3) get none of the one sample
    if strategy == "ddp":
        wrapped = DDPModel(model, b)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    elif strategy == "zero2":
        wrapped = ZeRO2Model(model, b)
        opt = ZeRO2Optimizer(wrapped, torch.optim.SGD, lr=0.1)
    elif strategy == "hybrid":
        wrapped = HybridShardedModel(model, b, dims=ParallelDims(dp=2, pp=2))
        rows = 1 - b.rank // 2 % 2  # the replica of ranks 2 and 3
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    else:
        wrapped = PipelineParallelModel(model, b, num_microbatches=1)
        rows = 0
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    batch = torch.randn(1, 3)[:rows], torch.randn(1, 2)[:rows]
    return wrapped.train_step(batch, F.mse_loss, opt)


@pytest.mark.parametrize("strategy, world", [("ddp", 2), ("zero2", 2), ("hybrid", 4), ("pipeline", 2)])
def test_an_empty_slice_is_refused(strategy, world):
    with pytest.raises(ConfigError, match="empty slice"):
        spawn(functools.partial(_step, strategy=strategy), world, timeout=20)
