"""GradientCompressionOptimizer with error feedback under ShardedGradScaler's documented loop with
``scaler.unscale_(opt)`` before the step (to clip): the scale saved with the residuals is the one
their backward ran at.

Before, torch hands ``step()`` ``grad_scale=None`` once ``unscale_`` has run, and the optimizer
took that for "no loss scaling" (scale 1): a run resumed with the saved scaler's state was
refused (saved at "scale 2", the growth factor, not 2**11), and one resumed with a fresh scaler
at another scale went on silently with residuals off by that factor (64x here)."""
import pytest
import torch
from torch import nn

from distframe import ConfigError, ShardedGradScaler, checkpoint, spawn
from tests.optimizers.test_compression_scale_resume import SAVED_AT, _batch, _build


def _train(model, opt, scaler, first, last, unscale_first):
    """Scale, backward, (unscale_, clip,) step, update, zero_grad; the saved scale after each."""
    saved_scales = []
    for step in range(first, last):
        x, y = _batch(step, model.backend.rank)
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if unscale_first:
            scaler.unscale_(opt)
            model.clip_grad_norm_(100.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if model.backend.rank == 0:  # which saves the scale (the same on every rank)
            saved_scales.append(float(opt.state_dict()["tensors"]["compression.loss_scale/scale@0"][0]))
    return saved_scales


def _scaler(init_scale=2.0 ** 10):
    return ShardedGradScaler("cpu", init_scale=init_scale, growth_interval=1)


@pytest.mark.parametrize("unscale_first", [True, False])
def test_the_saved_scale_is_the_scalers_whether_or_not_unscale_ran(unscale_first):
    def fn(backend):
        model, opt = _build(backend)
        scaler = _scaler()
        saved = _train(model, opt, scaler, 0, 3, unscale_first)
        return saved, scaler.get_scale()
    saved, scale = spawn(fn, 2, timeout=30)[0]
    # the residuals follow the scale as it grows (doubled at every update)
    assert saved == [2.0 ** 11, 2.0 ** 12, 2.0 ** 13] and scale == 2.0 ** 13


@pytest.mark.parametrize("resume_with", ["the saved scaler", "a fresh scaler"])
def test_an_unscale_loop_resumes_with_the_saved_scaler_and_refuses_another_scale(tmp_path, resume_with):
    def fn(backend):
        model, opt = _build(backend)
        scaler = _scaler()
        _train(model, opt, scaler, 0, SAVED_AT, unscale_first=True)
        checkpoint.save(tmp_path / "ck", model, opt, step=SAVED_AT)
        scaler_state = scaler.state_dict()
        _train(model, opt, scaler, SAVED_AT, SAVED_AT + 2, unscale_first=True)
        straight = model.gather_full_parameters()

        model, opt = _build(backend)
        checkpoint.load(tmp_path / "ck", model, opt)
        before = model.gather_full_parameters()
        if resume_with == "the saved scaler":
            resumed = _scaler()
            resumed.load_state_dict(scaler_state)
            _train(model, opt, resumed, SAVED_AT, SAVED_AT + 2, unscale_first=True)
            after = model.gather_full_parameters()
            return all(torch.equal(after[k], straight[k]) for k in straight)
        with pytest.raises(ConfigError, match=r"saved at loss scale 8192, but this step runs at the "
                                              r"scaler's loss scale 65536"):
            _train(model, opt, _scaler(2.0 ** 16), SAVED_AT, SAVED_AT + 1, unscale_first=True)
        after = model.gather_full_parameters()
        return all(torch.equal(after[k], before[k]) for k in before)  # the refused step moved nothing
    assert spawn(fn, 2, timeout=30) == [True, True]
