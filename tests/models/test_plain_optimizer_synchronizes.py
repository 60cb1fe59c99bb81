"""A plain torch.optim optimizer over a model-parallel model in a hand-written loop
(``loss.backward(); opt.step()``, or ShardedGradScaler(backend=model.backend).step(opt), the
documented way to scale such a model's loss) stepped gradients that nobody had synchronised:
train_step calls ``synchronize_gradients()``, a hand-written loop did not, so data-parallel
replicas (dp > 1) each stepped their own half-batch gradient and drifted apart, without a word.
The step now synchronises first (the plain-optimizer guard's step pre-hook; the scaler before its
inf check), and the loop equals one process on the whole batch (float64, 1e-12)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe import ShardedGradScaler
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models.hybrid import HybridShardedModel
from tests.models.common import SEED_LOCK
from tests.scaling import backward_and_step

STEPS = 3


def _mlp() -> nn.Module:
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batch(step):
    g = torch.Generator().manual_seed(10 + step)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64)
    return x, torch.randn(4, 3, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "ShardedGradScaler"])
def test_a_hand_written_loop_over_a_data_parallel_hybrid_equals_one_process(scaled):
    reference = _mlp()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step)
        F.mse_loss(reference(x), y).backward()
        opt.step()
        opt.zero_grad()

    def run(backend):
        model = HybridShardedModel(_mlp(), backend, dims=ParallelDims(dp=2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = ShardedGradScaler("cpu", init_scale=2.0 ** 8, backend=model.backend) if scaled else None
        rows = slice(2 * backend.rank, 2 * backend.rank + 2)
        for step in range(STEPS):
            x, y = _batch(step)
            backward_and_step(F.mse_loss(model(x[rows]), y[rows]), opt, scaler)
        return model.gather_full_parameters()

    for params in spawn(run, 2, timeout=30):
        for name, want in reference.state_dict().items():
            torch.testing.assert_close(params[name], want, rtol=0, atol=1e-12)
