"""``dropout_seed`` without tensor parallelism: a pipeline's (or a data-parallel hybrid's) dropout
draws from generators of each rank's own, so in-memory ranks (threads sharing torch's global
generator, whose draws interleave as the threads run) train the same twice. It was accepted and
ignored when tp was 1: two runs with one seed gave different losses, and seeds 7 and 8 (as
processes) the same."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from attention.dilated import DilatedAttention
from distframe.launch import spawn
from distframe.models.pipeline import PipelineParallelModel
from tests.models.common import SEED_LOCK


class Attend(nn.Module):
    """(B, T, 8) -> (B, T, 8) through a dilated attention with attention dropout, two heads."""

    def __init__(self):
        super().__init__()
        self.attention = DilatedAttention([4], [1], attention_dropout=0.5)

    def forward(self, x):
        heads = x.reshape(*x.shape[:2], 2, 4)
        return self.attention(heads, heads, heads).reshape(x.shape)


def model():
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), Attend(), nn.Tanh(), nn.Linear(8, 8),
                             nn.Dropout(0.5), nn.Linear(8, 3)).to(torch.float64)


def _losses(b, seed):
    pipe = PipelineParallelModel(model(), b, num_microbatches=2, split_points=[3], dropout_seed=seed)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, 8, generator=g, dtype=torch.float64), torch.randn(8, 4, 3, generator=g,
                                                                                dtype=torch.float64)
    kinds = sorted({type(m).__name__ for m in pipe.modules() if isinstance(m, (nn.Dropout, DilatedAttention))})
    return [pipe.train_step((x, y), F.mse_loss, opt) for _ in range(3)], kinds


def test_a_pipeline_with_a_dropout_seed_repeats_its_masks():
    first, again, other = (spawn(functools.partial(_losses, seed=seed), 2, timeout=30) for seed in (7, 7, 8))
    assert first == again
    assert first[0][0] != other[0][0]
    assert first[0][1] == ["RankDilatedAttention", "ReplicatedDropout"]  # stage 0's modules
    assert first[1][1] == ["ReplicatedDropout"]


def test_without_a_dropout_seed_dropout_stays_torchs():
    kinds = spawn(functools.partial(_losses, seed=None), 2, timeout=30)
    assert kinds[0][1] == ["DilatedAttention", "Dropout"] and kinds[1][1] == ["Dropout"]
