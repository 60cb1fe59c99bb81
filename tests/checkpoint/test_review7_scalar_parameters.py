"""Adam state of a model whose parameters are all 0-dim, saved under DDP: every piece of its state
is 0-dim there (moments and step alike), so the checkpoint kept it all as per-parameter scalars,
and a load into the flat shards of ZeRO-1/2/3 or FSDP gave the moments back 0-dim, failing the
next step inside Adam ("output with shape [] doesn't match the broadcast shape [1]")."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from tests.checkpoint.test_review7_complex import train_slices
from tests.models.common import STRATEGIES

LR = 0.1


class Affine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.5, dtype=torch.float64))
        self.b = nn.Parameter(torch.tensor(-0.2, dtype=torch.float64))

    def forward(self, x):
        return x * self.a + self.b


def _batches() -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(4):
        x = torch.randn(6, 1, generator=g, dtype=torch.float64)
        out.append((x, 2 * x + 1 + 0.1 * torch.randn(6, 1, generator=g, dtype=torch.float64)))
    return out


def _reference(**settings) -> dict:
    model = Affine()
    opt = torch.optim.Adam(model.parameters(), lr=LR, **settings)
    for x, y in _batches():
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(backend, strategy, steps, optimizer_cls=torch.optim.Adam, load_from=None, save_to=None,
         **settings):
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(Affine(), backend)
    opt = opt_cls(model, optimizer_cls, lr=LR, **settings)
    return train_slices(model, opt, [_batches()[s] for s in steps], steps[-1] + 1, load_from, save_to)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_ddp_checkpoint_of_scalar_parameters_resumes_under_every_strategy(tmp_path, strategy, world):
    spawn(lambda b: _run(b, "ddp", [0, 1], save_to=tmp_path / "ck"), 2, timeout=30)
    resumed = spawn(lambda b: _run(b, strategy, [2, 3], load_from=tmp_path / "ck"), world, timeout=30)
    for name, expected in _reference().items():
        for full in resumed:
            torch.testing.assert_close(full[name], expected, rtol=0, atol=1e-10)


def test_and_back_from_flat_shards_to_ddp(tmp_path):
    spawn(lambda b: _run(b, "ddp", [0], save_to=tmp_path / "first"), 2, timeout=30)
    spawn(lambda b: _run(b, "zero2", [1], load_from=tmp_path / "first", save_to=tmp_path / "again"), 3,
          timeout=30)
    resumed = spawn(lambda b: _run(b, "ddp", [2, 3], load_from=tmp_path / "again"), 2, timeout=30)
    for name, expected in _reference().items():
        torch.testing.assert_close(resumed[0][name], expected, rtol=0, atol=1e-10)


def test_the_group_settings_decide_which_state_is_per_element(tmp_path):
    # AMSGrad keeps a third per-element tensor (max_exp_avg_sq), which the probe must find too.
    spawn(lambda b: _run(b, "ddp", [0, 1], save_to=tmp_path / "ck", amsgrad=True), 2, timeout=30)
    resumed = spawn(lambda b: _run(b, "fsdp", [2, 3], load_from=tmp_path / "ck", amsgrad=True), 2,
                    timeout=30)
    for name, expected in _reference(amsgrad=True).items():
        torch.testing.assert_close(resumed[0][name], expected, rtol=0, atol=1e-10)


class TaggedAdam(torch.optim.Adam):
    """An optimizer that cannot be built from parameters alone."""

    def __init__(self, params, tag, **settings) -> None:
        super().__init__(params, **settings)
        self.tag = tag


def test_an_optimizer_whose_state_cannot_be_told_apart_is_refused_by_name(tmp_path):
    spawn(lambda b: _run(b, "ddp", [0], TaggedAdam, save_to=tmp_path / "ck", tag="x"), 2, timeout=30)
    with pytest.raises(ConfigError) as caught:
        spawn(lambda b: _run(b, "zero1", [1], TaggedAdam, load_from=tmp_path / "ck", tag="x"), 2, timeout=30)
    message = str(caught.value)
    assert "'a'" in message and "TaggedAdam" in message and "DDPModel" in message, message
