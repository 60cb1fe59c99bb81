"""Error-feedback residuals are kept in units of the loss scale (test_compression_loss_scaling.py),
and a checkpoint holds them so. ``checkpoint.save`` does not hold the scaler: a run resumed with
a fresh ShardedGradScaler at another scale, or with none, added the residuals to the next
gradients off by new scale / old scale (65536x with no scaler after one at 2**16), without a
word. The optimizer now saves the scale its residuals are in; a resumed step at another scale is
a ConfigError naming both scales and the fix, before anything moves; with the scaler's state
restored the resumed run equals the straight one (float64, bitwise in practice)."""
import copy

import pytest
import torch
from torch import nn

from distframe import ConfigError, DDPModel, ShardedGradScaler, checkpoint, spawn
from distframe.optimizers.compressed import GradientCompressionOptimizer
from distframe.optimizers.compression import TopKCompressor
from tests.scaling import backward_and_step

torch.manual_seed(77)
MLP = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 2)).double()
SAVED_AT = 3


def _batch(step, rank):
    g = torch.Generator().manual_seed(50 + step)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    y = torch.randn(8, 2, generator=g, dtype=torch.float64)
    return x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]


def _build(backend):
    model = DDPModel(copy.deepcopy(MLP), backend)
    opt = GradientCompressionOptimizer(model, torch.optim.SGD, compressor=TopKCompressor(0.2), lr=0.1)
    return model, opt


def _train(model, opt, scaler, steps, first=0):
    for step in range(first, first + steps):
        x, y = _batch(step, model.backend.rank)
        backward_and_step(nn.functional.mse_loss(model(x), y), opt, scaler)


def _scaler(**kw):
    return ShardedGradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2, **kw)


@pytest.mark.parametrize("resume_with", ["a fresh scaler", "no scaler", "the saved scaler"])
def test_a_resumed_step_at_another_loss_scale_is_refused(tmp_path, resume_with):
    def fn(backend):
        model, opt = _build(backend)
        scaler = _scaler()
        _train(model, opt, scaler, SAVED_AT)
        checkpoint.save(tmp_path / "ckpt", model, opt, step=SAVED_AT)
        scaler_state = scaler.state_dict()
        _train(model, opt, scaler, 2, first=SAVED_AT)
        straight = model.gather_full_parameters()

        model, opt = _build(backend)
        checkpoint.load(tmp_path / "ckpt", model, opt)
        before = model.gather_full_parameters()
        resumed = None if resume_with == "no scaler" else _scaler()
        if resume_with == "the saved scaler":
            resumed.load_state_dict(scaler_state)
            _train(model, opt, resumed, 2, first=SAVED_AT)
            after = model.gather_full_parameters()
            return all(torch.equal(after[k], straight[k]) for k in straight)
        with pytest.raises(ConfigError, match=r"saved at loss scale 2048, but this step runs .*restore"):
            _train(model, opt, resumed, 1, first=SAVED_AT)
        after = model.gather_full_parameters()
        return all(torch.equal(after[k], before[k]) for k in before)  # the refused step moved nothing
    assert spawn(fn, 2, timeout=30) == [True, True]


def test_a_run_without_loss_scaling_resumes_as_before(tmp_path):
    def fn(backend):
        model, opt = _build(backend)
        _train(model, opt, None, SAVED_AT)
        checkpoint.save(tmp_path / "plain", model, opt, step=SAVED_AT)
        _train(model, opt, None, 2, first=SAVED_AT)
        straight = model.gather_full_parameters()
        model, opt = _build(backend)
        checkpoint.load(tmp_path / "plain", model, opt)
        _train(model, opt, None, 2, first=SAVED_AT)
        after = model.gather_full_parameters()
        return all(torch.equal(after[k], straight[k]) for k in straight)
    assert spawn(fn, 2, timeout=30) == [True, True]
