"""Checkpoints of models the main grid does not build: one-element shards and parameters."""
import pytest
import torch
from torch import nn

from distframe import checkpoint
from distframe.launch import spawn
from tests.models.common import SEED_LOCK, STRATEGIES


def _one_output_model() -> nn.Module:
    # Three parameters in all; the bias has one element (a regression head): under DDP its Adam
    # state is one element, and at world size 3 every flat shard is one element.
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(2, 1)).double()


def _batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(12, 2, generator=g, dtype=torch.float64)
    y = torch.randn(12, 1, generator=g, dtype=torch.float64)
    per = 12 // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _mse(output, target):
    return ((output - target) ** 2).mean()


def _train(backend, strategy, steps, load_from=None, save_to=None):
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(_one_output_model(), backend)
    opt = opt_cls(model, torch.optim.Adam, lr=0.1)
    if load_from is not None:
        checkpoint.load(load_from, model, opt)
    for step in steps:
        model.train_step(_batch(step, backend.rank, backend.world_size), _mse, opt)
    if save_to is not None:
        checkpoint.save(save_to, model, opt, step=steps[-1] + 1)
    return model.gather_full_parameters()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("save_world, load_world", [(3, 3), (3, 1), (1, 3), (3, 2)])
def test_one_element_optimizer_state_round_trips(tmp_path, strategy, save_world, load_world):
    # One-element state (Adam's exp_avg of a one-element shard) was stored as a scalar like
    # Adam's step, so loading it failed or made a 0-d moment that the next step could not use.
    path = tmp_path / "ckpt"
    spawn(lambda b: _train(b, strategy, [0, 1], save_to=path), save_world, timeout=30)
    resumed = spawn(lambda b: _train(b, strategy, [2, 3], load_from=path), load_world, timeout=30)
    expected = spawn(lambda b: _train(b, strategy, [0, 1, 2, 3]), 1, timeout=30)[0]
    for params in resumed:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10)
