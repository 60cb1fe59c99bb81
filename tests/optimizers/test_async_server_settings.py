"""AsyncSGDOptimizer checkpoints hold the server's hyperparameters, whichever rank serves.

The server alone applies updates, so its param groups' settings (a rate set by hand before
serve(), as async_schedule.py advises) are the run's. A checkpoint takes them from rank 0's
``state_dict()``; with ``server_rank != 0`` that was a worker's, still at the construction
values, so a resumed run trained at the old rate and momentum without a word.
``synchronize_parameters()``, which every rank calls before a save, now brings them too."""
import json

import pytest
import torch
from torch import nn

from distframe import checkpoint, spawn
from distframe.models import DDPModel
from distframe.optimizers.async_sgd import AsyncSGDOptimizer
from tests.models.common import SEED_LOCK


def _model(b):
    with SEED_LOCK:
        torch.manual_seed(3)
        module = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    return DDPModel(module, b)


def _batch(worker, k):
    g = torch.Generator().manual_seed(100 * worker + k)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64)
    return x, x[:, :2].cos()


def _sgd(b, server_rank):
    model = _model(b)
    return model, AsyncSGDOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, server_rank=server_rank,
                                    max_staleness=0, deterministic=True)


def _train(b, opt, steps=2):
    if opt.is_server:
        opt.serve()
        return
    for k in range(steps):
        opt.train_step(_batch(b.rank, k), nn.functional.mse_loss)
    opt.finish()


@pytest.mark.parametrize("server_rank", [0, 1, 2])
def test_a_checkpoint_holds_the_servers_rate_and_momentum(tmp_path, server_rank):
    def fn(b):
        model, opt = _sgd(b, server_rank)
        if opt.is_server:  # the whole run's rate, set by hand on the server before serve()
            opt.param_groups[0]["lr"] = 0.01
            opt.param_groups[0]["momentum"] = 0.5
        _train(b, opt)
        opt.synchronize_parameters()
        synchronized = (opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"])
        saved = opt.state_dict()["param_groups"][0]
        checkpoint.save(tmp_path / "ck", model, opt, step=2)
        model, opt = _sgd(b, server_rank)
        checkpoint.load(tmp_path / "ck", model, opt)
        return synchronized, (saved["lr"], saved["momentum"]), (opt.param_groups[0]["lr"],
                                                                opt.param_groups[0]["momentum"])
    for synchronized, saved, loaded in spawn(fn, 3, timeout=30):
        assert synchronized == saved == loaded == (0.01, 0.5)
    meta = json.loads((tmp_path / "ck" / "metadata.json").read_text())
    group = meta["optimizer"]["param_groups"][0]
    assert (group["lr"], group["momentum"]) == (0.01, 0.5)


def test_a_tensor_rate_and_tuple_betas_keep_their_types_on_the_workers():
    """The server's settings are applied in place: a tensor lr stays a tensor (capturable
    optimizers update it in place), betas stay a tuple."""
    def fn(b):
        model = _model(b)
        opt = AsyncSGDOptimizer(model, torch.optim.Adam, lr=torch.tensor(1e-2), foreach=False,
                                server_rank=1, max_staleness=0, deterministic=True)
        rate = opt.param_groups[0]["lr"]
        if opt.is_server:
            rate.fill_(1e-3)
            opt.param_groups[0]["betas"] = (0.8, 0.9)
        _train(b, opt)
        opt.synchronize_parameters()
        group = opt.param_groups[0]
        return group["lr"] is rate, float(group["lr"]), group["betas"]
    for same_tensor, lr, betas in spawn(fn, 3, timeout=30):
        assert same_tensor and lr == pytest.approx(1e-3) and betas == (0.8, 0.9)
        assert isinstance(betas, tuple)
