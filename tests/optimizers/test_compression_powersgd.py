"""PowerSGD through GradientCompressionOptimizer (in-memory engine): it keeps sending after a
step with a zero gradient, it is scale-equivariant down to tiny gradients, and it sends fp16 and
bf16 gradients as well as float32 ones."""
import copy

import pytest
import torch
from torch import nn

from distframe import spawn
from distframe.backends.types import ReduceOp
from distframe.models import DDPModel
from distframe.optimizers.compressed import GradientCompressionOptimizer
from distframe.optimizers.compression import PowerSGDCompressor

torch.manual_seed(4321)
# Built once: threads share torch's global generator, so ranks copy this instead of seeding.
# Weights 24 x 12 and 16 x 24 are compressible at rank 2; the last layer's 3 x 16 is not.
MLP = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(12, 12, generator=g, dtype=torch.float64)
    y = torch.randn(12, 3, generator=g, dtype=torch.float64)
    return x[rank * 6:(rank + 1) * 6], y[rank * 6:(rank + 1) * 6]


def _powersgd_applied(scale):
    """Per step: (applied mean gradient / scale, true mean gradient) of PowerSGD rank 2 on the
    MLP's two compressible weights, on 2 ranks; step 1 gets a zero gradient (loss times 0).
    The learning rate is divided by ``scale``, so the parameters follow the same path."""
    def fn(b):
        model = DDPModel(copy.deepcopy(MLP), b)
        opt = GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.05 / scale, error_feedback=False,
                                           compressor=PowerSGDCompressor(rank=2, start_iter=0))
        plain = copy.deepcopy(MLP)
        out = []
        for step in range(5):
            x, y = _batch(step, b.rank)
            factor = 0.0 if step == 1 else scale
            plain.load_state_dict(model.wrapped_model.state_dict())
            plain.zero_grad()
            (factor * nn.functional.mse_loss(plain(x), y)).backward()
            true = torch.cat([plain[k].weight.grad.reshape(-1) for k in (0, 2)]) / scale
            b.all_reduce(true, ReduceOp.AVG)
            (factor * nn.functional.mse_loss(model(x), y)).backward()
            model.synchronize_gradients()
            out.append((torch.cat([model.wrapped_model[k].weight.grad.reshape(-1) for k in (0, 2)]) / scale,
                        true))
            opt.step()
            opt.zero_grad()
        return out
    return spawn(fn, 2, timeout=60)[0]


def test_powersgd_keeps_sending_after_a_step_with_a_zero_gradient():
    """A step with no gradient (a layer unused for a step) zeroes the warm-start factors; that
    must not silence the layer for the rest of training."""
    for step, (applied, true) in enumerate(_powersgd_applied(1.0)):
        if step == 1:
            assert torch.equal(applied, torch.zeros_like(applied))
        else:  # rank 2 of these gradients holds most of them
            assert applied.norm() >= 0.5 * true.norm() > 0


def test_powersgd_is_scale_equivariant_down_to_tiny_gradients():
    """Gradients 1e-6 or 1e-12 times smaller are sent 1e-6 or 1e-12 times smaller, not dropped
    as (numerically) zero: whether a column of P is dependent is relative to its own size."""
    reference = _powersgd_applied(1.0)
    for scale in (1e-6, 1e-12):
        for (applied, _), (expected, _) in zip(_powersgd_applied(scale), reference):
            torch.testing.assert_close(applied, expected, rtol=1e-9, atol=1e-12)


class Weighted(nn.Module):
    """``(w * x).sum()``: the gradient of ``w`` is ``x``, so each rank chooses its gradient."""

    def __init__(self, shape, dtype):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(shape, dtype=dtype))

    def forward(self, x):
        return (self.w * x).sum()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_powersgd_sends_a_rank_2_half_precision_gradient_whole(dtype):
    """Before, P was orthogonalised in the gradient's dtype with a cut-off of 1000 ulps: in bf16
    (7.8 times a column's norm) every column was dropped and nothing was sent, in fp16 (0.98)
    the second one; and from the second step, when the warm start Q has the gradient's size,
    P = M Q of fp16 entries in the hundreds (loss-scaled gradients) overflowed: nothing was sent.
    Rank 2 sends a rank-2 gradient whole, at every step: to the gradient's own rounding."""
    g = torch.Generator().manual_seed(3)
    u, v = (torch.linalg.qr(torch.randn(n, 2, generator=g)).Q for n in (20, 16))
    # Singular values 4000 and 3000 (entries up to 1211): one power iteration finds their span.
    gradient = (u @ torch.diag(torch.tensor([4000.0, 3000.0])) @ v.t()).to(dtype)

    def fn(b):
        model = DDPModel(Weighted(gradient.shape, dtype), b)
        opt = GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.0,
                                           compressor=PowerSGDCompressor(rank=2, start_iter=0))
        applied = []
        for _ in range(3):
            model(gradient).backward()
            model.synchronize_gradients()
            applied.append(model.wrapped_model.w.grad.clone())
            opt.step()
            opt.zero_grad()
        return applied
    single = PowerSGDCompressor(rank=2, start_iter=0)
    alone = [single.decompress(*single.compress(gradient, key="w")) for _ in range(3)]
    eps = torch.finfo(dtype).eps
    for applied in [alone] + spawn(fn, 2, timeout=30):
        for step, got in enumerate(applied):
            assert got.dtype == dtype
            error = (got.double() - gradient.double()).norm() / gradient.double().norm()
            assert error <= 2 * eps, f"step {step}: relative error {float(error):.3g}"
