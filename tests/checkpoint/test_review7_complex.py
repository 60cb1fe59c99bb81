"""Checkpoints of models with complex parameters and buffers: safetensors has no complex dtypes,
so every save failed with a bare ``KeyError: torch.complex128``, though DDP and ZeRO train such
models exactly. They are stored as their real view now and come back complex, under any strategy
and world size, and from ``consolidate``."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from distframe import checkpoint
from distframe.launch import spawn
from tests.models.common import STRATEGIES

C = torch.complex128
LR = 0.05


class Complex(nn.Module):
    """Complex parameters (a matrix, a vector, a 0-dim scale) and a complex buffer; real output."""

    def __init__(self, only_scale: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.only_scale = only_scale
        self.scale = nn.Parameter(torch.tensor(0.5 + 0.1j, dtype=C))
        if not only_scale:
            self.c = nn.Parameter(0.3 * torch.randn(3, 3, dtype=C, generator=g))
            self.shift = nn.Parameter(0.1 * torch.randn(3, dtype=C, generator=g))
        self.register_buffer("phase", torch.randn(3, dtype=C, generator=g))

    def forward(self, x):
        z = x.to(C) * self.phase
        if not self.only_scale:
            z = z @ self.c + self.shift
        return (z * self.scale).abs()


def _batches() -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 3, generator=g, dtype=torch.float64),
             torch.randn(6, 3, generator=g, dtype=torch.float64)) for _ in range(4)]


def _reference(only_scale: bool = False) -> dict:
    """Single-process Adam over all four batches."""
    model = Complex(only_scale)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for x, y in _batches():
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(backend, strategy, steps, *, only_scale=False, load_from=None, save_to=None, with_optimizer=True):
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(Complex(only_scale), backend)
    opt = opt_cls(model, torch.optim.Adam, lr=LR)
    return train_slices(model, opt, [_batches()[s] for s in steps], steps[-1] + 1, load_from, save_to,
                        with_optimizer)


def train_slices(model, opt, batches, step, load_from, save_to, with_optimizer=True):
    """Loads ``load_from`` (a checkpoint, or None), trains on this rank's rows of each 6-row batch,
    saves to ``save_to`` (or not) as of ``step``; returns the full parameters."""
    backend = model.backend
    if load_from is not None:
        checkpoint.load(load_from, model, opt)
    per = 6 // backend.world_size
    lo = backend.rank * per
    for x, y in batches:
        model.train_step((x[lo:lo + per], y[lo:lo + per]), F.mse_loss, opt)
    if save_to is not None:
        checkpoint.save(save_to, model, opt if with_optimizer else None, step=step)
    return model.gather_full_parameters()


def _assert_matches(full: dict, expected: dict) -> None:
    for name, tensor in expected.items():
        assert full[name].dtype == C, name
        torch.testing.assert_close(full[name], tensor, rtol=0, atol=1e-10)


@pytest.mark.parametrize("saved", list(STRATEGIES))
@pytest.mark.parametrize("loaded,world", [("zero2", 3), ("ddp", 1)])
def test_a_complex_model_resumes_under_another_strategy_and_world_size(tmp_path, saved, loaded, world):
    if saved == loaded:
        loaded = "fsdp"
    spawn(lambda b: _run(b, saved, [0, 1], save_to=tmp_path / "ck"), 2, timeout=30)
    resumed = spawn(lambda b: _run(b, loaded, [2, 3], load_from=tmp_path / "ck"), world, timeout=30)
    expected = _reference()
    for full in resumed:
        _assert_matches(full, expected)
        torch.testing.assert_close(full["phase"], Complex().phase, rtol=0, atol=0)


def test_a_model_of_one_0dim_complex_parameter_resumes_under_zero2(tmp_path):
    spawn(lambda b: _run(b, "ddp", [0, 1], only_scale=True, save_to=tmp_path / "ck"), 2, timeout=30)
    resumed = spawn(lambda b: _run(b, "zero2", [2, 3], only_scale=True, load_from=tmp_path / "ck"), 3,
                    timeout=30)
    _assert_matches(resumed[0], _reference(only_scale=True))


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_consolidate_gives_the_complex_tensors_back(tmp_path, with_optimizer):
    full = spawn(lambda b: _run(b, "zero3", [0], save_to=tmp_path / "ck", with_optimizer=with_optimizer),
                 2, timeout=30)[0]
    state = checkpoint.consolidate(tmp_path / "ck")
    assert state.keys() == full.keys() == {"scale", "c", "shift", "phase"}
    for name, tensor in full.items():
        assert state[name].dtype == C and state[name].shape == tensor.shape, name
        assert torch.equal(state[name], tensor), name
    Complex().load_state_dict(state)  # a plain module takes it


def test_complex_tensors_are_stored_as_their_real_view_and_say_so(tmp_path):
    spawn(lambda b: _run(b, "ddp", [0], save_to=tmp_path / "ck"), 2, timeout=30)
    meta = json.loads((tmp_path / "ck" / "metadata.json").read_text())
    assert meta["parameters"]["c"]["dtype"] == "complex128"
    with safe_open(str(tmp_path / "ck" / meta["files"][0]["file"]), framework="pt") as f:
        stored = set(json.loads(f.metadata()["complex"]))
        assert "buffer/phase" in stored and "param/c@0" in stored and "optim.exp_avg/c@0" in stored
        assert f.get_tensor("param/c@0").dtype == torch.float64
        assert f.get_tensor("buffer/phase").shape == (3, 2)
