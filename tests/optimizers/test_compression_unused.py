"""GradientCompressionOptimizer with find_unused_parameters=True (in-memory engine, float64):
a parameter no rank used in a step is skipped by the optimizer, so its residual must not
change, or what it held back is lost and error feedback no longer delivers every gradient."""
import copy

import pytest
import torch
from torch import nn

from distframe import spawn
from distframe.models import DDPModel
from distframe.optimizers.compressed import GradientCompressionOptimizer
from distframe.optimizers.compression import Int8Compressor, PowerSGDCompressor, TopKCompressor

torch.manual_seed(21)


class _TwoHeads(nn.Module):
    """Head ``c`` is used on even steps only (by every rank), head ``b`` on odd ones."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x, step):
        h = self.a(x).tanh()
        return self.c(h) if step % 2 == 0 else self.b(h)


NET = _TwoHeads().double()
LR = 0.1


def _batch(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64)
    return x, x[:, :3].sin()


@pytest.mark.parametrize("compressor", [TopKCompressor(0.2), Int8Compressor(chunk_size=4, stochastic=False),
                                        PowerSGDCompressor(rank=1, start_iter=0)], ids=repr)
def test_sent_plus_residual_equals_true_gradients_when_heads_go_unused(compressor):
    """Plain SGD: lr * (sum over steps of the applied mean gradient) is the parameters' total
    change, so sum(applied) * world + sum of residuals over ranks must equal the sum of the
    true local gradients (to float64 rounding). Before, a head's residual shrank by what it
    sent in a step where the head went unused, and the optimizer never applied that."""
    def fn(b):
        model = DDPModel(copy.deepcopy(NET), b, find_unused_parameters=True)
        opt = GradientCompressionOptimizer(model, torch.optim.SGD, lr=LR,
                                           compressor=copy.deepcopy(compressor))
        plain = copy.deepcopy(NET)
        names = [n for n, _ in plain.named_parameters()]
        true_sum = {n: torch.zeros_like(p) for n, p in plain.named_parameters()}
        start = {n: p.detach().clone() for n, p in model.wrapped_model.named_parameters()}
        for step in range(5):
            x, y = _batch(step, b.rank)
            plain.load_state_dict(model.wrapped_model.state_dict())
            plain.zero_grad()
            nn.functional.mse_loss(plain(x, step), y).backward()
            for n, p in plain.named_parameters():
                if p.grad is not None:
                    true_sum[n] += p.grad
            opt.zero_grad()
            nn.functional.mse_loss(model(x, step), y).backward()
            opt.step()
        params = dict(model.wrapped_model.named_parameters())
        errors = []
        for n in names:
            applied = (start[n] - params[n].detach()) / LR * b.world_size
            residual = opt.residuals.get(n, torch.zeros_like(applied)).clone()
            truth = true_sum[n].clone()
            b.all_reduce(residual)
            b.all_reduce(truth)
            errors.append((applied + residual - truth).abs().max().item())
        return max(errors)
    for err in spawn(fn, 2, timeout=60):
        assert err <= 1e-12
