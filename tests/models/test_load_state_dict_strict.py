"""``load_state_dict(state, strict=False)`` on a wrapped model does what torch's does on the unwrapped
one: parameters and buffers the state lacks keep their current values, names the model lacks are
ignored, and it returns ``_IncompatibleKeys(missing_keys, unexpected_keys)``. The fine-tuning
pattern (a pretrained body, a fresh head) then trains as one process trains it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from tests.models.common import (SEED_LOCK, SETTINGS, STRATEGIES, build_model, global_batches, loss_fn,
                                 rank_slice)

WORLD = 2
PRETRAINED = build_model(seed=3).state_dict()
BODY = {k: v for k, v in PRETRAINED.items() if not k.startswith("3.")}  # a fresh head: '3.' missing
EXTRA = {"extra.weight": torch.zeros(2, dtype=torch.float64)}


def single_process(state: dict[str, torch.Tensor], steps: int):
    model = build_model()
    keys = model.load_state_dict(state, strict=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in global_batches(steps, 12):
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return keys, {n: p.detach().clone() for n, p in model.state_dict().items()}


def _fine_tune(backend, strategy: str, state, steps: int):
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(build_model(), backend, **SETTINGS[strategy])
    keys = model.load_state_dict(state, strict=False)
    opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
    for batch in global_batches(steps, 12):
        model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
    return keys, model.gather_full_parameters()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_pretrained_body_loads_without_its_head_and_trains_as_one_process(strategy):
    state = dict(BODY, **EXTRA)
    expected_keys, expected = single_process(state, 3)
    assert expected_keys.missing_keys == ["3.weight", "3.bias"]  # what torch says
    for keys, full in spawn(lambda b: _fine_tune(b, strategy, state, 3), WORLD, timeout=60):
        assert keys.missing_keys == expected_keys.missing_keys
        assert keys.unexpected_keys == expected_keys.unexpected_keys == ["extra.weight"]
        for name, value in expected.items():
            torch.testing.assert_close(full[name], value, rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_merged_pieces_without_the_head_keep_its_values(strategy):
    # The same through every rank's state_dict() merged (another run's, saved without its head).
    def pieces(backend):
        model = STRATEGIES[strategy][0](build_model(seed=3), backend, **SETTINGS[strategy])
        return model.state_dict()
    merged = {k: v for state in spawn(pieces, WORLD, timeout=60) for k, v in state.items()
              if "/3." not in k}

    def load(backend):
        model = STRATEGIES[strategy][0](build_model(), backend, **SETTINGS[strategy])
        keys = model.load_state_dict(merged, strict=False)
        with pytest.raises(ConfigError, match="strict=False"):  # strict: the error says what to pass
            model.load_state_dict(merged)
        return keys, model.gather_full_parameters()
    fresh = build_model().state_dict()
    for keys, full in spawn(load, WORLD, timeout=60):
        assert keys.missing_keys == ["3.weight", "3.bias"] and keys.unexpected_keys == []
        for name, value in full.items():
            torch.testing.assert_close(value, (fresh if name.startswith("3.") else PRETRAINED)[name],
                                       rtol=0, atol=0, msg=name)


def batch_norm_model(seed: int = 0) -> nn.Sequential:
    with SEED_LOCK:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)).double()
        model[1].running_mean.uniform_()  # a buffer that differs from a fresh model's
        return model


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_missing_buffers_keep_their_values_and_strict_errors_say_what_to_pass(strategy):
    pretrained = batch_norm_model(seed=3).state_dict()
    state = {k: v for k, v in pretrained.items() if not k.startswith("1.running")}
    plain = batch_norm_model()
    expected_keys = plain.load_state_dict(state, strict=False)

    def load(backend):
        model = STRATEGIES[strategy][0](batch_norm_model(), backend, **SETTINGS[strategy])
        with pytest.raises(ConfigError, match="strict=False"):
            model.load_state_dict(state)
        with pytest.raises(ConfigError, match=r"lacks parameter\(s\) \['2.weight'.*strict=False"):
            model.load_state_dict({k: v for k, v in state.items() if not k.startswith("2.")})
        keys = model.load_state_dict(state, strict=False)
        strict_keys = model.load_state_dict(pretrained)
        return keys, strict_keys, model.gather_full_parameters()
    for keys, strict_keys, full in spawn(load, WORLD, timeout=60):
        assert keys == expected_keys and keys.missing_keys == ["1.running_mean", "1.running_var"]
        assert strict_keys.missing_keys == [] and strict_keys.unexpected_keys == []
        for name, value in pretrained.items():
            torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=name)
    loaded_with_missing = spawn(lambda b: _load_only(b, strategy, state), WORLD, timeout=60)
    for full in loaded_with_missing:
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=name)


def _load_only(backend, strategy: str, state):
    model = STRATEGIES[strategy][0](batch_norm_model(), backend, **SETTINGS[strategy])
    model.load_state_dict(state, strict=False)
    return model.gather_full_parameters()
