"""Error-feedback residuals of half-precision parameters under loss scaling: a residual near the
top of fp16's range, times the scale's growth, overflowed to inf, and every later step was then
skipped (inf times the backoff factor stays inf). Residuals of fp16 and bf16 parameters are kept
in float32, so growth past 65504 makes the next gradient overflow once (the step is skipped and
the scale backs off, which brings the residual back into range) instead of forever."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from distframe import ShardedGradScaler, spawn
from distframe.models import DDPModel
from distframe.optimizers.compressed import GradientCompressionOptimizer
from distframe.optimizers.compression import Int8Compressor, TopKCompressor


class WeightedHalf(nn.Module):
    """``(w * x).sum()`` with fp16 ``w``: the gradient of ``w`` is ``x`` (times the loss scale)."""

    def __init__(self, size):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(size, dtype=torch.float16))

    def forward(self, x):
        return (self.w * x).sum()


# Step 0 sends 60000 and keeps 50000 back (top-k of 1 of 2); the scale then doubles, so the
# residual is 100000: past fp16's 65504. Later gradients are small.
GRADIENTS = [[60000.0, 50000.0]] + [[1.0, 2.0]] * 5


def _run(world=2):
    """Per rank: which steps were taken, the gradients applied (unscaled, summed over those
    steps), the residual (unscaled) at the end and its dtype."""
    def fn(b):
        model = DDPModel(WeightedHalf(2), b)
        opt = GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.0,
                                           compressor=TopKCompressor(0.5))
        scaler = ShardedGradScaler("cpu", init_scale=1.0, growth_interval=1)
        taken, applied = [], torch.zeros(2, dtype=torch.float64)
        for x in GRADIENTS:
            scaler.scale(model(torch.tensor(x, dtype=torch.float16))).backward()
            model.synchronize_gradients()
            grad = model.wrapped_model.w.grad.double() / float(scaler.get_scale())
            before = opt.iteration
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            taken.append(opt.iteration > before)
            applied += grad if taken[-1] else 0.0
        residual = opt.residuals["w"].double() / float(scaler.get_scale())
        return taken, applied, residual, opt.residuals["w"].dtype
    return spawn(fn, world, timeout=30)


def test_residual_growth_past_fp16_range_does_not_poison_later_steps():
    for taken, applied, residual, dtype in _run():
        assert torch.isfinite(residual).all(), residual
        # Step 1's gradient plus the grown residual overflows fp16: that step is skipped and the
        # scale backs off; the steps after it train again.
        assert taken[0] and not taken[1] and all(taken[2:]), taken
        # Nothing is lost: what was applied plus what is still held back is the sum of the
        # gradients of the steps taken (to the rounding of the fp16 gradients applied).
        given = sum(torch.tensor(x, dtype=torch.float64) for x, t in zip(GRADIENTS, taken) if t)
        torch.testing.assert_close(applied + residual, given, rtol=2.0 ** -10, atol=0.0)
        assert dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("compressor", [TopKCompressor(0.5), Int8Compressor(chunk_size=2, stochastic=False)],
                         ids=repr)
def test_residuals_of_half_parameters_are_float32_and_what_was_lost(dtype, compressor):
    """The residual is the float32 difference between what was given and what was sent, not that
    difference rounded to the parameter's dtype."""
    x = torch.tensor([3.0, 1 / 3], dtype=dtype)

    def fn(b):
        model = DDPModel(WeightedHalf(2).to(dtype), b)
        opt = GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.0, compressor=compressor)
        model(x).backward()
        opt.step()
        return opt.residuals["w"]
    sent = compressor.decompress(*compressor.compress(x))
    for residual in spawn(fn, 1, timeout=30):
        assert residual.dtype == torch.float32
        assert torch.equal(residual, x.float() - sent.float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_residual_below_the_gradients_rounding_is_delayed_not_dropped(dtype):
    """Step 0 holds back ``small``; at step 1 that element's gradient is 1000, whose ulp in fp16
    (0.5) or bf16 (4) is far above ``small``: gradient plus residual rounds to 1000 and is sent
    whole. ``small`` stays in the residual (before, in the gradient's dtype, it was lost); it is
    a multiple of float32's ulp at 1000 (2**-14), so float32 holds 1000 + small exactly."""
    small = 2.0 ** -10

    def fn(b):
        model = DDPModel(WeightedHalf(2).to(dtype), b)
        opt = GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.0,
                                           compressor=TopKCompressor(0.5))
        for x in ([1.0, small], [0.0, 1000.0]):
            model(torch.tensor(x, dtype=dtype)).backward()
            opt.step()
            opt.zero_grad()
        return opt.residuals["w"]
    for residual in spawn(fn, 2, timeout=30):
        assert residual.tolist() == [0.0, small]


def test_float32_residuals_of_fp16_parameters_survive_a_checkpoint(tmp_path):
    from distframe import checkpoint

    def first(b):
        model = DDPModel(WeightedHalf(2), b)
        opt = GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.0,
                                           compressor=TopKCompressor(0.5))
        model(torch.tensor([3.0, 1 / 3], dtype=torch.float16)).backward()
        opt.step()
        checkpoint.save(tmp_path / "ck", model, opt, step=1)
        return opt.residuals["w"]

    def second(b):
        model = DDPModel(WeightedHalf(2), b)
        opt = GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.0,
                                           compressor=TopKCompressor(0.5))
        checkpoint.load(tmp_path / "ck", model, opt)
        return opt.residuals["w"]
    saved = spawn(first, 2, timeout=30)
    for before, after in zip(saved, spawn(second, 2, timeout=30)):
        assert after.dtype == torch.float32 and torch.equal(after, before)
