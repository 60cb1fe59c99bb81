"""Loss scaling (GradScaler) with sharded optimizers: every rank that steps together must take the
same skip decision and keep the same scale, equal to one process's plain GradScaler."""
import copy

import pytest
import torch
from torch import nn

from distframe.launch import spawn
from tests.models.common import SEED_LOCK, STRATEGIES

IN, HIDDEN, OUT = 4, 8, 2
WORLD, ROWS = 2, 8            # 4 rows per rank
OVERFLOW_STEP, OVERFLOW_ROW = 1, 6  # a row of rank 1's slice
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


class _GradTimes(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient of row i by ``factor[i]``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.save_for_backward(factor)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (factor,) = ctx.saved_tensors
        return grad * factor, None


class SpikeNet(nn.Module):
    """An MLP plus one scalar ``spike`` whose gradient a row makes inf (its last input column is
    that row's factor, 1 otherwise): one element, so exactly one rank's shard holds it."""

    def __init__(self):
        super().__init__()
        self.spike = nn.Parameter(torch.zeros(1))
        self.body = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))

    def forward(self, inputs):
        x, factor = inputs[:, :IN], inputs[:, IN:]
        return self.body(x) + _GradTimes.apply(self.spike * x[:, :1], factor)


def build(dtype):
    with SEED_LOCK:
        torch.manual_seed(0)
        return SpikeNet().to(dtype)


def batches(dtype, steps=4):
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(steps):
        x = torch.randn(ROWS, IN, generator=g, dtype=torch.float64)
        factor = torch.ones(ROWS, 1, dtype=torch.float64)
        if step == OVERFLOW_STEP:
            factor[OVERFLOW_ROW] = float("inf")
        out.append((torch.cat([x, factor], 1).to(dtype), torch.randn(ROWS, OUT, generator=g).to(dtype)))
    return out


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)


def make_scaler(scaler_cls):
    # Growth every 2 clean steps, so the run both backs off (the overflow) and grows.
    return scaler_cls("cpu", init_scale=2.0 ** 8, growth_interval=2)


def reference(dtype, unscale_first):
    """One process, plain GradScaler, whole batches: (scale, parameters) after every step."""
    model = build(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = make_scaler(torch.amp.GradScaler)
    history = []
    for x, y in batches(dtype):
        scaler.scale(loss_fn(model(x), y)).backward()
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        history.append((scaler.get_scale(), copy.deepcopy(model.state_dict())))
    return history


def local_overflow(opt):
    """Whether this rank's shard (what its GradScaler inspects) holds a non-finite gradient."""
    return any(p.grad is not None and not torch.isfinite(p.grad).all()
               for group in opt.param_groups for p in group["params"])


def sharded_run(strategy, dtype, unscale_first, scaler_cls):
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build(dtype), backend)
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        scaler = make_scaler(scaler_cls)
        history, overflows = [], None
        for step, batch in enumerate(batches(dtype)):
            rows = slice(backend.rank * ROWS // WORLD, (backend.rank + 1) * ROWS // WORLD)
            x, y = batch[0][rows], batch[1][rows]
            scaler.scale(loss_fn(model(x), y)).backward()
            if step == OVERFLOW_STEP:
                model.synchronize_gradients()
                flag = torch.tensor([float(local_overflow(opt))])
                overflows = backend.all_gather(flag).tolist()
            if unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            history.append((scaler.get_scale(), model.gather_full_parameters()))
        return history, overflows
    return spawn(run, WORLD, timeout=20)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp"])
def test_sharded_scaler_equals_one_process_with_an_overflow_in_one_shard(strategy, dtype):
    expected = reference(dtype, unscale_first=False)
    for history, overflows in sharded_run(strategy, dtype, False, torch.amp.GradScaler):
        # The premise: only one rank's shard overflows at OVERFLOW_STEP.
        assert sorted(overflows) == [0.0, 1.0]
        for step, ((scale, params), (want_scale, want)) in enumerate(zip(history, expected)):
            assert scale == want_scale, f"step {step}"
            for name, value in want.items():
                torch.testing.assert_close(params[name], value, rtol=0, atol=TOLERANCE[dtype])
