"""GradientCompressionOptimizer checkpoints loaded at another world size (in-memory engine,
float64): the error-feedback residuals still carry the gradient that was held back."""
import copy

import pytest
import torch
from torch import nn

from distframe import checkpoint, spawn
from distframe.models import DDPModel
from distframe.optimizers.compressed import GradientCompressionOptimizer
from distframe.optimizers.compression import TopKCompressor

torch.manual_seed(8)
MLP = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).double()


def _build(b):
    model = DDPModel(copy.deepcopy(MLP), b)
    return model, GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.1, compressor=TopKCompressor(0.2))


def _mean_residual(b, opt):
    """(1/world) * sum over ranks of the residuals: what the averaged gradient has yet to get."""
    params = opt.model.wrapped_model.named_parameters()
    # a rank added by growing the world has none yet: zeros
    flat = torch.cat([opt.residuals.get(n, torch.zeros_like(p)).reshape(-1) for n, p in params])
    b.all_reduce(flat)
    return flat / b.world_size


@pytest.mark.parametrize("new_world", [2, 3, 4, 6])
def test_residuals_keep_their_mean_when_the_world_size_changes(tmp_path, new_world):
    """Saved at 4 ranks. Before, loading at 2 or 3 dropped the residuals of ranks 2 and 3
    (and at 6 the two new ranks started at zero, diluting the mean by 4/6)."""
    def first(b):
        model, opt = _build(b)
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + b.rank)
            x = torch.randn(3, 5, generator=g, dtype=torch.float64)
            model.train_step((x, x[:, :2].cos()), nn.functional.mse_loss, opt)
        checkpoint.save(tmp_path / "ck", model, opt, step=3)
        return _mean_residual(b, opt)

    def second(b):
        model, opt = _build(b)
        checkpoint.load(tmp_path / "ck", model, opt)
        return _mean_residual(b, opt)
    saved = spawn(first, 4, timeout=60)[0]
    assert saved.abs().max() > 0
    for loaded in spawn(second, new_world, timeout=60):
        assert (loaded - saved).abs().max().item() <= 1e-14 * saved.abs().max().item()
