"""Attention dropout drawn from torch's global generator under tensor parallelism.

A replicated ``nn.MultiheadAttention(dropout=0.3)`` or ``F.scaled_dot_product_attention(...,
dropout_p=0.3)`` beside a planned MLP drew another mask on each tensor rank, and the replicated
parameters drifted apart (1e-3 after 3 steps) with no error, while ``F.dropout`` in a forward is
refused ([Note: draws from the global generator]). Neither can be given a generator, so both are
refused at the first forward in training mode, on every tensor rank, naming the module or the op
and the fix; with their dropout off, or evaluated, they run as the dense model does. float64, 1e-10.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import TensorParallelModel
from tests.models.common import SEED_LOCK
from tests.models.test_review7_mp_tied_weight_edits import sgd_losses

TOL = dict(rtol=1e-10, atol=1e-10)
WIDTH = 8
PLAN = {"up": "column", "down": "row"}


class WithAttention(nn.Module):
    """``nn.MultiheadAttention(dropout)`` (replicated) and a planned MLP."""

    def __init__(self, dropout, need_weights=False):
        super().__init__()
        self.need_weights = need_weights
        self.attn = nn.MultiheadAttention(WIDTH, 2, dropout=dropout, batch_first=True, dtype=torch.float64)
        self.up, self.down = nn.Linear(WIDTH, 16, dtype=torch.float64), nn.Linear(16, 3, dtype=torch.float64)

    def forward(self, x):
        h = x + self.attn(x, x, x, need_weights=self.need_weights)[0]
        return self.down(F.gelu(self.up(h)))


class WithScaledDotProduct(nn.Module):
    """``F.scaled_dot_product_attention`` with ``dropout_p`` (``in_eval``: also in eval mode)."""

    def __init__(self, dropout_p, in_eval=False):
        super().__init__()
        self.dropout_p, self.in_eval = dropout_p, in_eval
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, dtype=torch.float64)
        self.up, self.down = nn.Linear(WIDTH, 16, dtype=torch.float64), nn.Linear(16, 3, dtype=torch.float64)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        p = self.dropout_p if self.training or self.in_eval else 0.0
        h = x + F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        return self.down(F.gelu(self.up(h)))


def seeded(build):
    with SEED_LOCK:
        torch.manual_seed(0)
        return build()


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (4, 5), generator=g)


def cross_entropy(out, target):
    return F.cross_entropy(out.reshape(-1, 3), target.reshape(-1))


MHA_ERROR = (r"calls nn.MultiheadAttention 'attn' with dropout=0.3, whose attention dropout draws from "
             r"torch's global generator.*set its dropout to 0 \(attn.dropout = 0.0")
REFUSED = [
    (functools.partial(WithAttention, 0.3), MHA_ERROR),
    (functools.partial(WithAttention, 0.3, need_weights=True), MHA_ERROR),
    (functools.partial(WithScaledDotProduct, 0.3),
     r"calls 'scaled_dot_product_attention' with dropout_p=0.3, which draws from torch's global generator"
     r".*dropout_p=0 under"),
]


@pytest.mark.parametrize("build,message", REFUSED, ids=["mha", "mha-need-weights", "sdpa"])
def test_attention_dropout_from_the_global_generator_is_a_config_error(build, message):
    x, y = data()

    def run(backend):
        model = TensorParallelModel(seeded(build), backend, plan=PLAN, dropout_seed=1)
        model.eval()
        model(x)  # evaluation draws nothing from nn.MultiheadAttention (training=False)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ConfigError, match=message):
            model.train_step((x, y), cross_entropy, opt)
        return True

    assert spawn(run, 2) == [True, True]  # every tensor rank raises alike


def dense_steps(model, x, y, steps=3):
    return sgd_losses(model, [(x, y)] * steps, cross_entropy, lr=0.1)


ACCEPTED = [
    (functools.partial(WithAttention, 0.0), "mha-dropout-0"),
    (functools.partial(WithScaledDotProduct, 0.0), "sdpa-dropout-p-0"),
]


@pytest.mark.parametrize("build", [b for b, _ in ACCEPTED], ids=[i for _, i in ACCEPTED])
def test_attention_without_dropout_trains_as_the_dense_model(build):
    x, y = data()
    dense = seeded(build)
    want = dense_steps(copy.deepcopy(dense), x, y)
    reference = copy.deepcopy(dense)
    dense_steps(reference, x, y)

    def run(backend):
        model = TensorParallelModel(copy.deepcopy(dense), backend, plan=PLAN, dropout_seed=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = [model.train_step((x, y), cross_entropy, opt) for _ in range(3)]
        return losses, model.gather_full_parameters()

    for losses, full in spawn(run, 2):
        assert losses == pytest.approx(want, rel=1e-12)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(full[name], value, **TOL, msg=name)


@pytest.mark.parametrize("build", [functools.partial(WithAttention, 0.3),
                                   functools.partial(WithScaledDotProduct, 0.3)], ids=["mha", "sdpa"])
def test_attention_with_dropout_evaluates_as_the_dense_model(build):
    x, _ = data()
    dense = seeded(build).eval()
    with torch.no_grad():
        want = dense(x)

    def run(backend):
        model = TensorParallelModel(copy.deepcopy(dense), backend, plan=PLAN, dropout_seed=1)
        model.eval()
        with torch.no_grad():
            return model(x)

    for out in spawn(run, 2):
        torch.testing.assert_close(out, want, **TOL)


def test_scaled_dot_product_dropout_in_eval_mode_is_refused_too():
    # F.scaled_dot_product_attention draws whenever dropout_p > 0, whatever the module's mode.
    x, _ = data()

    def run(backend):
        model = TensorParallelModel(seeded(functools.partial(WithScaledDotProduct, 0.3, in_eval=True)),
                                    backend, plan=PLAN, dropout_seed=1)
        model.eval()
        with pytest.raises(ConfigError, match=r"'scaled_dot_product_attention'"):
            model(x)
        return True

    assert spawn(run, 2) == [True, True]
