"""Data-parallel models around modules ported from real code, from a third review (float64,
1e-10 against one process on the global batch)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.launch import spawn
from tests.models.common import SEED_LOCK, SETTINGS, STRATEGIES


class HookNormalized(nn.Module):
    """torch.nn.utils.weight_norm and spectral_norm, the hook-based forms (HiFi-GAN, WaveNet and
    EnCodec code use them): forward pre-hooks that compute ``weight`` from other parameters."""

    def __init__(self) -> None:
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the hook-based forms are deprecated
            self.a = torch.nn.utils.weight_norm(nn.Linear(4, 6))
            self.b = torch.nn.utils.spectral_norm(nn.Linear(6, 6))
        self.c = nn.Linear(6, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _hook_normalized():
    with SEED_LOCK:
        torch.manual_seed(0)
        return HookNormalized().double()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=g, dtype=torch.float64),
             torch.randn(6, 3, generator=g, dtype=torch.float64)) for _ in range(3)]


def _trains_as_one_process(build, strategy: str, settings: dict) -> None:
    """``build()``'s model trained 3 Adam steps under ``strategy`` at world 2 (3 rows per rank)
    equals it trained on the whole batch in one process (float64, 1e-10)."""
    batches = _batches()
    reference = build()
    opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for x, y in batches:
        F.mse_loss(reference(x), y).backward()
        opt.step()
        opt.zero_grad()

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build(), backend, **settings)
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        for x, y in batches:
            rows = slice(3 * backend.rank, 3 * backend.rank + 3)
            model.train_step((x[rows], y[rows]), F.mse_loss, opt)
        return model.gather_full_parameters()

    for params in spawn(run, 2):
        for name, value in reference.state_dict().items():
            assert params[name].shape == value.shape, name
            torch.testing.assert_close(params[name], value, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_hook_based_weight_and_spectral_norm_train_as_one_process(strategy):
    # Before: the units' gather pre-hook ran after weight_norm's (registered first), which read
    # the NaN stand-ins: a ConfigError telling the user to call the unit as a whole, which the
    # model did. FSDP2 prepends its pre-forward hook; so do the units now. Under FSDP a, b and c
    # are units of their own.
    settings = {"auto_wrap_min_params": 10} if strategy == "fsdp" else SETTINGS[strategy]
    _trains_as_one_process(_hook_normalized, strategy, settings)


class WithEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.empty = nn.Parameter(torch.zeros(0, 4))

    def forward(self, x):
        return self.a(x) + self.empty.sum()


def _with_empty():
    with SEED_LOCK:
        torch.manual_seed(0)
        return WithEmpty().double()


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_a_parameter_without_elements_trains(strategy):
    # Before: its stand-in shares the NaN's data pointer, so reading it in its own unit's forward
    # was refused as a read of a resharded parameter.
    _trains_as_one_process(_with_empty, strategy, {})
