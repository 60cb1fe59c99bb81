"""FP16Compressor's range on the wire (in-memory engine, float32 gradients): a sum of ranks'
gradients that each fit fp16 does not overflow (each rank sends its share of the mean), a value
whose share does not fit becomes inf (so a GradScaler skips the step), and the error-feedback
residual is exactly what the compression lost; fp16 gradients whose mean fits fp16 arrive finite,
summed (fp16) or gathered (top-k, int8)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from distframe import spawn
from distframe.models import DDPModel
from distframe.optimizers.compressed import GradientCompressionOptimizer
from distframe.optimizers.compression import FP16Compressor, Int8Compressor, TopKCompressor

FP16_MAX = torch.finfo(torch.float16).max  # 65504
# Each share is rounded to fp16 (half an ulp: at most 2**-11 of it, and of the sum of shares that
# have one sign, as here), the wire sum is rounded once more (2**-11), dividing by the world size
# in float32 adds 2**-24.
RTOL = 2 * 2.0 ** -11 + 2.0 ** -24


class Weighted(nn.Module):
    """``(w * x).sum()``: the gradient of ``w`` is ``x``, so each rank chooses its gradient."""

    def __init__(self, size):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(size))

    def forward(self, x):
        return (self.w * x).sum()


def _synchronized(world, gradient_of_rank, **opt_kw):
    """Every rank's gradient after the compressed exchange, and its residual after one step."""
    def fn(b):
        x = gradient_of_rank(b.rank)
        model = DDPModel(Weighted(x.numel()), b)
        opt = GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.0,
                                           compressor=FP16Compressor(), **opt_kw)
        model(x).backward()
        model.synchronize_gradients()
        grad = model.wrapped_model.w.grad.clone()
        opt.step()
        return grad, opt.residuals.get("w")
    return spawn(fn, world, timeout=30)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_sum_of_gradients_that_fit_fp16_does_not_overflow(world):
    big = torch.tensor([FP16_MAX, 40000.0, -60000.0, 0.5, 1 / 3])
    scales = [1.0, 0.75, 0.5, 1.0][:world]  # rank r sends big * scales[r]
    expected = big * (sum(scales) / world)  # |mean| <= FP16_MAX: it fits fp16
    for grad, _ in _synchronized(world, lambda r: big * scales[r]):
        assert torch.isfinite(grad).all(), f"the wire sum overflowed: {grad}"
        torch.testing.assert_close(grad, expected, rtol=RTOL, atol=0.0)


@pytest.mark.parametrize("world", [2, 3])
def test_values_that_do_not_fit_fp16_become_inf_not_a_finite_wrong_value(world):
    # Element 0: one rank's share is far beyond fp16. Element 1: every share fits, but the mean
    # (1e5) does not. Element 2: the sum's sign. Element 3: a finite neighbour stays exact.
    def gradient(r):
        return torch.tensor([1e9 if r == 0 else 1.0, 1e5, -1e9, 2.0])
    for grad, _ in _synchronized(world, gradient):
        assert grad[0] == float("inf") and grad[1] == float("inf") and grad[2] == -float("inf")
        assert grad[3] == 2.0


def test_the_residual_is_what_the_compression_lost():
    # World 3: shares are x / 4 (the power of two >= 3, an exact division). 0.5 and FP16_MAX have
    # shares fp16 holds exactly (nothing lost); 1/3 loses its rounding; 1e-7 has a share below
    # half of fp16's smallest subnormal (2**-25), so all of it is kept back for a later step.
    x = torch.tensor([0.5, FP16_MAX, 1 / 3, 1e-7])
    for _, residual in _synchronized(3, lambda r: x.clone()):
        sent = (x / 4).half().float() * 4
        assert torch.equal(residual, x - sent)
        assert residual[0] == 0 and residual[1] == 0 and residual[3] == x[3]
        assert 0 < abs(residual[2]) <= 4 * 2.0 ** -15  # half an fp16 ulp of 1/12 (2**-14), times 4


class WeightedHalf(Weighted):
    def __init__(self, size):
        super().__init__(size)
        self.w.data = self.w.data.half()


def test_fp16_gradients_are_averaged_not_summed():
    # Before: for fp16 gradients decompress returned the payload itself, and scaling the
    # residual's copy of it in place put whole gradients on the wire: the sum, not the mean.
    def fn(b):
        x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float16) * (b.rank + 1)
        model = DDPModel(WeightedHalf(3), b)
        GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.0, compressor=FP16Compressor())
        model(x).backward()
        model.synchronize_gradients()
        return model.wrapped_model.w.grad.clone()
    for grad in spawn(fn, 2, timeout=30):
        assert grad.dtype == torch.float16
        assert torch.equal(grad, torch.tensor([1.5, 3.0, 4.5], dtype=torch.float16))


@pytest.mark.parametrize("world", [2, 3])
def test_fp16_gradients_whose_mean_fits_fp16_do_not_overflow(world):
    # Before: the wire sum of shares (the mean times W / p) was scaled back by p in fp16 itself,
    # so a mean above 65504 / p became inf although it fits fp16 (the fp32 test above missed it).
    def fn(b):
        x = torch.tensor([40000.0, 60000.0, -50000.0, 1.0], dtype=torch.float16)
        model = DDPModel(WeightedHalf(4), b)
        GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.0, compressor=FP16Compressor())
        model(x).backward()
        model.synchronize_gradients()
        return model.wrapped_model.w.grad.clone(), x
    for grad, x in spawn(fn, world, timeout=30):
        # Every rank sends x; the shares x / p are exact; the wire sum and the result are each
        # rounded to fp16 once (RTOL above).
        torch.testing.assert_close(grad, x, rtol=RTOL, atol=0.0)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("compressor", [TopKCompressor(1.0), Int8Compressor(chunk_size=2, stochastic=False)],
                         ids=repr)
def test_gathered_fp16_gradients_whose_mean_fits_fp16_do_not_overflow(world, compressor):
    # Before: every rank's decompressed payload was summed in fp16 and then divided by the
    # world size, so W ranks sending 40000 summed to inf; GradScaler would skip the step.
    x = torch.tensor([40000.0, 60000.0, -50000.0, 1.0], dtype=torch.float16)
    one_rank = compressor.decompress(*compressor.compress(x))  # what each rank sends

    def fn(b):
        model = DDPModel(WeightedHalf(4), b)
        GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.0, compressor=copy.deepcopy(compressor))
        model(x).backward()
        model.synchronize_gradients()
        return model.wrapped_model.w.grad.clone()
    for grad in spawn(fn, world, timeout=30):
        assert grad.dtype == torch.float16
        # W equal contributions summed and divided in float32, rounded to fp16 once.
        torch.testing.assert_close(grad, one_rank, rtol=2.0 ** -11, atol=0.0)
