"""GradientCompressionOptimizer under loss scaling: error-feedback residuals are kept in the units
of the loss scale of the backward that made them, so when the scale moves (growth, or backing off
after an overflow) they must move with it. A run with a ShardedGradScaler whose scale changes at
every step must equal, to float64 rounding, the same run with no loss scaling at all (the scales
are powers of two, so scaling is exact and top-k picks the same entries)."""
import copy
import math

import pytest
import torch
from torch import nn

from distframe import ConfigError, DDPModel, ShardedGradScaler, spawn
from distframe.optimizers.compressed import GradientCompressionOptimizer
from distframe.optimizers.compression import PowerSGDCompressor, TopKCompressor

torch.manual_seed(4321)
MLP = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 2)).double()
WORLD, ROWS, STEPS, OVERFLOW_STEP = 2, 8, 6, 3
# Bitwise in practice; the bound leaves room for a platform's reassociation only.
RTOL, ATOL = 1e-12, 1e-15


def _batch(step, rank):
    g = torch.Generator().manual_seed(10 + step)
    x = torch.randn(ROWS, 6, generator=g, dtype=torch.float64)
    y = torch.randn(ROWS, 2, generator=g, dtype=torch.float64)
    rows = slice(rank * ROWS // WORLD, (rank + 1) * ROWS // WORLD)
    return x[rows], y[rows]


def _run(compressor, scaler_cls=None, error_feedback=True):
    """Each rank's parameters and residuals (in unscaled units) after STEPS steps, the one at
    OVERFLOW_STEP overflowing (skipped: by the scaler, or by zero_grad() without a step)."""
    def fn(backend):
        model = DDPModel(copy.deepcopy(MLP), backend)
        opt = GradientCompressionOptimizer(model, torch.optim.SGD, compressor=copy.deepcopy(compressor),
                                           error_feedback=error_feedback, lr=0.1, momentum=0.9)
        # The scale doubles after every clean step and halves at the overflow.
        scaler = scaler_cls("cpu", init_scale=2.0 ** 4, growth_interval=1) if scaler_cls else None
        for step in range(STEPS):
            x, y = _batch(step, backend.rank)
            loss = nn.functional.mse_loss(model(x), y) * (math.inf if step == OVERFLOW_STEP else 1.0)
            if scaler is None:
                loss.backward()
                if step != OVERFLOW_STEP:
                    opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
        scale = scaler.get_scale() if scaler else 1.0
        return (model.gather_full_parameters(), {k: v / scale for k, v in opt.residuals.items()},
                scale)
    return spawn(fn, WORLD, timeout=30)


@pytest.mark.parametrize("compressor", [TopKCompressor(0.2), PowerSGDCompressor(rank=1, start_iter=1)],
                         ids=repr)
def test_residuals_follow_the_loss_scale_as_it_grows_and_backs_off(compressor):
    plain = _run(compressor)
    scaled = _run(compressor, ShardedGradScaler)
    for (params, residuals, scale), (want, want_residuals, _) in zip(scaled, plain, strict=True):
        assert scale == 2.0 ** (4 + STEPS - 2), "the scale grew at every clean step and halved once"
        assert residuals.keys() == want_residuals.keys() and residuals
        for name in want:
            torch.testing.assert_close(params[name], want[name], rtol=RTOL, atol=ATOL)
        for name in want_residuals:
            torch.testing.assert_close(residuals[name], want_residuals[name], rtol=RTOL, atol=ATOL)


def test_a_plain_grad_scaler_is_refused_where_residuals_depend_on_the_scale():
    # A plain GradScaler never tells the optimizer its scale changed: the residuals would be
    # added to the next gradients at the old scale (off by 2x at every change), silently.
    with pytest.raises(ConfigError, match="ShardedGradScaler"):
        _run(TopKCompressor(0.2), torch.amp.GradScaler)


def test_without_error_feedback_a_plain_grad_scaler_equals_no_scaling():
    plain = _run(TopKCompressor(0.2), error_feedback=False)
    scaled = _run(TopKCompressor(0.2), torch.amp.GradScaler, error_feedback=False)
    for (params, _, _), (want, _, _) in zip(scaled, plain, strict=True):
        for name in want:
            torch.testing.assert_close(params[name], want[name], rtol=RTOL, atol=ATOL)
