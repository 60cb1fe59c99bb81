"""``model.train_step(batch, loss_fn, opt)`` with an AsyncSGDOptimizer is refused at once.

Its ranks never step together, and model.train_step all-reduces the loss, a collective the
server never joins: after a pull() it hung until the backend's timeout (300 s by default);
without one it said "pull() parameters before the first forward (train_step does it for you)",
as if the loop were right. Checkpoints, which check the optimizer too, still take it."""
import pytest
import torch
from torch import nn

from distframe import checkpoint, spawn
from distframe.errors import ConfigError
from distframe.models import DDPModel
from distframe.optimizers.async_sgd import AsyncSGDOptimizer
from tests.models.common import SEED_LOCK


def _build(b):
    with SEED_LOCK:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    model = DDPModel(module, b)
    return model, AsyncSGDOptimizer(model, torch.optim.SGD, lr=0.1, max_staleness=0, deterministic=True)


def _batch(k):
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
    return x, x[:, :2].cos()


@pytest.mark.parametrize("pulled", [False, True])
def test_model_train_step_names_the_optimizers_own(pulled):
    def fn(b):
        model, opt = _build(b)
        if not opt.is_server and pulled:
            opt.pull()
        with pytest.raises(ConfigError, match=r"optimizer\.train_step\(batch, loss_fn\)") as refused:
            model.train_step(_batch(b.rank), nn.functional.mse_loss, opt)
        if opt.is_server:
            return opt.serve().updates_per_worker, str(refused.value)
        loss = opt.train_step(_batch(b.rank), nn.functional.mse_loss)  # the right loop still works
        opt.finish()
        return loss, str(refused.value)
    results = spawn(fn, 3, timeout=10)
    assert results[0][0] == {1: 1, 2: 1}
    assert "serve()" in results[0][1]


def test_checkpoints_still_take_the_async_optimizer(tmp_path):
    def fn(b):
        model, opt = _build(b)
        if opt.is_server:
            opt.serve()
        else:
            opt.train_step(_batch(b.rank), nn.functional.mse_loss)
            opt.finish()
        opt.synchronize_parameters()
        checkpoint.save(tmp_path / "ck", model, opt, step=1)
        model, opt = _build(b)
        checkpoint.load(tmp_path / "ck", model, opt)
        return True
    assert spawn(fn, 3, timeout=10) == [True] * 3
