"""Ops between a 'column' layer and its 'row' that work along the split features.

Each rank computes on its own slice of the features there, which equals the dense model only for
ops that act on each feature by itself. A fused gate/up projection cut by ``chunk``, a softmax or
a hand-written RMSNorm over the features, a slice of some features: each gave another model with
no error (a fused SwiGLU's output was 0.63 off, its loss 0.898 against the dense 0.694). They are
now a ConfigError naming the layer and the op ([Note: ops across the split features]); models
that keep to each feature, or reshape the features into heads first, train as the dense model.
"""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import TensorParallelModel
from tests.models.common import SEED_LOCK

TOL = 1e-10


class FusedSwiGLU(nn.Module):  # Phi-3's gate_up_proj
    def __init__(self):
        super().__init__()
        self.gate_up, self.down = nn.Linear(4, 16), nn.Linear(8, 4)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Mlp(nn.Module):
    """fc_in -> ``between`` -> fc_out."""

    def __init__(self, between):
        super().__init__()
        self.fc_in, self.fc_out, self.between = nn.Linear(4, 8), nn.Linear(8, 4), between

    def forward(self, x):
        return self.fc_out(self.between(self.fc_in(x)))


def hand_rms_norm(h):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


class GatedMlp(nn.Module):
    """Keeps to each feature: a gate and an up projection, each 'column', and a per-token gate."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)
        self.token_gate = nn.Linear(4, 1)

    def forward(self, x):
        h = F.silu(self.gate(x)) * self.up(x)
        return self.down(F.dropout(h, 0.0) * torch.sigmoid(self.token_gate(x)))


class HeadsAttention(nn.Module):
    """A hand-written attention: q/k/v 'column', split into heads before the softmax (over keys)."""

    def __init__(self, width=8, head_dim=2):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out, self.head_dim = nn.Linear(width, width), head_dim

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        weights = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim ** 0.5, dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(batch, seq, -1))


def build(make):
    with SEED_LOCK:
        torch.manual_seed(0)
        return make().double()


def step(model, x):
    """One SGD step on ``x``; the output before it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = model(x)
    out.square().sum().backward()
    optimizer.step()
    return out.detach()


def _tp_step(backend, make, plan, x):
    model = TensorParallelModel(build(make), backend, plan=plan)
    return step(model, x), model.gather_full_parameters()


MIXING = [
    (FusedSwiGLU, {"gate_up": "column", "down": "row"}, "gate_up", "chunk"),
    (functools.partial(Mlp, nn.Softmax(-1)), {"fc_in": "column", "fc_out": "row"}, "fc_in", "softmax"),
    (functools.partial(Mlp, hand_rms_norm), {"fc_in": "column", "fc_out": "row"}, "fc_in", "mean"),
    (functools.partial(Mlp, lambda h: torch.cat([h[..., :1] * 0, h[..., 1:]], -1)),
     {"fc_in": "column", "fc_out": "row"}, "fc_in", "__getitem__"),
    (functools.partial(Mlp, lambda h: F.layer_norm(h, h.shape[-1:])), {"fc_in": "column", "fc_out": "row"},
     "fc_in", "layer_norm"),
]


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("make,plan,layer,op", MIXING, ids=[case[3] for case in MIXING])
def test_an_op_along_the_split_features_is_a_config_error(make, plan, layer, op, grad):
    def run(backend):
        model = TensorParallelModel(build(make), backend, plan=plan)
        with torch.set_grad_enabled(grad), pytest.raises(
                ConfigError, match=rf"plan\['{layer}'\]='column' is paired.*'{op}' works along those split "
                                   r"features.*Split a fused layer into one Linear per part"):
            model(torch.randn(3, 4, dtype=torch.float64))
        return True

    assert spawn(run, 2) == [True, True]


@pytest.mark.parametrize("make,plan,shape", [
    (GatedMlp, {"gate": "column", "up": "column", "down": "row"}, (3, 4)),
    (HeadsAttention, {"q": "column", "k": "column", "v": "column", "out": "row"}, (2, 5, 8)),
    (lambda: nn.Sequential(nn.Linear(4, 8), nn.Softmax(-1), nn.Linear(8, 4)), {"0": "column", "2": "row"},
     (3, 4)),
    (lambda: nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8, elementwise_affine=False), nn.GELU(),
                           nn.Linear(8, 4)), {"0": "column", "3": "row"}, (3, 4)),
], ids=["gated-mlp", "heads-attention", "sequential-softmax", "sequential-norm"])
def test_models_that_keep_to_each_feature_or_to_heads_equal_the_dense_one(make, plan, shape):
    """No false alarm where the split is right: per-feature ops, heads split before the softmax;
    an nn.Sequential with a softmax or a norm between its column and row does not pair them (the
    column's output is gathered), so it computes the dense model too."""
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    dense = build(make)
    want = step(dense, x)
    for out, full in spawn(lambda backend: _tp_step(backend, make, plan, x), 2):
        assert (out - want).abs().max() < TOL
        for name, param in dense.named_parameters():  # after a step: the gradients were exact
            assert (full[name] - param.detach()).abs().max() < TOL, name


class FunctionalDropout(nn.Module):
    """F.dropout on the replicated activation after the row, as many Hugging Face models write it."""

    def __init__(self, draw):
        super().__init__()
        self.fc1, self.fc2, self.norm, self.draw = nn.Linear(4, 8), nn.Linear(8, 4), nn.LayerNorm(4), draw

    def forward(self, x):
        return self.norm(self.draw(self.fc2(torch.relu(self.fc1(x))), self.training))


DRAWS = [
    (lambda h, training: F.dropout(h, 0.5, training), "dropout"),
    (lambda h, training: h + 0.1 * torch.randn_like(h), "randn_like"),
]


@pytest.mark.parametrize("draw,op", DRAWS, ids=[op for _, op in DRAWS])
def test_a_draw_from_the_global_generator_in_the_forward_is_a_config_error(draw, op):
    """On in-memory ranks the per-rank losses were [2.396, 1.600, 1.254] and [1.963, 1.520, 1.217]
    and the replicated parameters 2.3 apart after 3 steps: each tensor rank drew another mask from
    the generator the threads share. Refused at the first forward in training mode, also when an
    evaluation came first ([Note: draws from the global generator])."""
    def run(backend):
        model = TensorParallelModel(build(lambda: FunctionalDropout(draw)), backend,
                                    plan={"fc1": "column", "fc2": "row"})
        x = torch.randn(5, 4, dtype=torch.float64)
        if op == "dropout":
            model.eval()
            model(x)  # draws nothing
            model.train()
        with pytest.raises(ConfigError, match=rf"calls '{op}', which draws from torch's global generator"
                                              r".*Use an nn.Dropout module instead of F.dropout"):
            model(x)
        return True

    assert spawn(run, 2) == [True, True]


def test_draws_given_a_generator_or_p_zero_are_left_to_the_model():
    def draw(h, training):
        own = torch.Generator().manual_seed(3)
        return F.dropout(h, 0.0, training) + 0 * torch.rand(h.shape, generator=own, dtype=h.dtype)

    make = functools.partial(FunctionalDropout, draw)
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    dense = build(make)
    want = step(dense, x)
    for out, full in spawn(lambda backend: _tp_step(backend, make, {"fc1": "column", "fc2": "row"}, x), 2):
        assert (out - want).abs().max() < TOL
        assert all((full[n] - p.detach()).abs().max() < TOL for n, p in dense.named_parameters())
