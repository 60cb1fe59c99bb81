"""Optimizers with several param groups of different settings: each group gets back the settings
of the saved group that trained its parameters, and a group whose parameters were trained with
different settings is refused rather than given one group's."""
import pytest
import torch

from distframe import checkpoint
from distframe.errors import ConfigError
from distframe.launch import spawn
from tests.models.common import STRATEGIES, build_model, global_batches, loss_fn, rank_slice

WEIGHTS = {"lr": 0.1, "weight_decay": 0.0}
BIASES = {"lr": 0.01, "weight_decay": 0.5}


def _grouped(model, biases_first=False):
    """A torch.optim.AdamW over a DDPModel's parameters: weights and biases in two groups."""
    named = dict(model.module.named_parameters())
    weights = [p for n, p in named.items() if n.endswith("weight")]
    biases = [p for n, p in named.items() if n.endswith("bias")]
    groups = [{"params": weights, **WEIGHTS}, {"params": biases, **BIASES}]
    return torch.optim.AdamW(groups[::-1] if biases_first else groups)


def _save(backend, path, uniform=False):
    model = STRATEGIES["ddp"][0](build_model(), backend)
    opt = _grouped(model)
    for group in opt.param_groups if uniform else []:
        group.update(BIASES)
    model.train_step(rank_slice(global_batches(1, 12)[0], backend.rank, backend.world_size), loss_fn, opt)
    checkpoint.save(path, model, opt, step=1)


def _settings(opt):
    return [{"lr": g["lr"], "weight_decay": g["weight_decay"]} for g in opt.param_groups]


def test_groups_built_in_another_order_get_their_own_settings(tmp_path):
    # The saved groups were matched by position: the biases' group got the weights' settings.
    path = tmp_path / "ckpt"
    spawn(lambda b: _save(b, path), 2, timeout=30)

    def load(backend):
        model = STRATEGIES["ddp"][0](build_model(seed=3), backend)
        opt = _grouped(model, biases_first=True)
        for group in opt.param_groups:  # other settings, so that only the load sets them right
            group.update(lr=0.7, weight_decay=0.2)
        checkpoint.load(path, model, opt)
        return _settings(opt)
    for settings in spawn(load, 3, timeout=30):
        assert settings == [BIASES, WEIGHTS]


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_one_group_over_parameters_saved_with_different_settings_is_refused(tmp_path, strategy):
    # A sharded optimizer (one group) silently took the first saved group's lr and weight decay
    # for every parameter, the biases' included.
    path = tmp_path / "ckpt"
    spawn(lambda b: _save(b, path), 2, timeout=30)

    def load(backend):
        model = STRATEGIES[strategy][0](build_model(seed=3), backend)
        opt = STRATEGIES[strategy][1](model, torch.optim.AdamW, lr=0.5)
        try:
            checkpoint.load(path, model, opt)
        except ConfigError as exc:
            return str(exc)
        return _settings(opt)
    for message in spawn(load, 2, timeout=30):
        assert isinstance(message, str), message
        assert "param groups [0, 1] with different settings" in message
        assert "lr=[0.1, 0.01]" in message and "without the optimizer" in message


def test_one_group_loads_a_checkpoint_whose_groups_share_their_settings(tmp_path):
    path = tmp_path / "ckpt"
    spawn(lambda b: _save(b, path, uniform=True), 2, timeout=30)

    def load(backend):
        model = STRATEGIES["zero2"][0](build_model(seed=3), backend)
        opt = STRATEGIES["zero2"][1](model, torch.optim.AdamW, lr=0.5)
        checkpoint.load(path, model, opt)
        return _settings(opt)
    for settings in spawn(load, 2, timeout=30):
        assert settings == [BIASES]
