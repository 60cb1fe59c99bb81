"""A tensor-parallel plan over a size tp does not divide: the ConfigError names the planned module
(in a plan of many layers, 'out_features (5)' alone does not say which one to change)."""
import pytest
import torch
from torch import nn

from attention.model import DilatedTransformerConfig, DilatedTransformerLM
from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import TensorParallelModel
from tests.models.common import SEED_LOCK


class MLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(4, hidden), nn.Linear(hidden, 4)

    def forward(self, x):
        return self.fc_out(torch.relu(self.fc_in(x)))


def lm_with_heads(num_heads):
    config = DilatedTransformerConfig.preset(
        "tiny", seq_len=16, embed_dim=24, num_heads=num_heads, num_layers=1,
        segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4))
    with SEED_LOCK:
        torch.manual_seed(0)
        return DilatedTransformerLM(config).double()


@pytest.mark.parametrize("build,plan,world,match", [
    (lambda: MLP(5), {"fc_in": "column", "fc_out": "row"}, 2, r"'fc_in': out_features \(5\) is not"),
    (lambda: nn.Sequential(MLP(6)), {"0.fc_in": "column", "0.fc_out": "row"}, 4,
     r"'0.fc_in': out_features \(6\) is not"),
    (lambda: lm_with_heads(6), None, 4, r"'blocks.0.attn': num_heads \(6\) is not"),  # the LM's plan
])
def test_a_size_tp_does_not_divide_names_the_planned_module(build, plan, world, match):
    with pytest.raises(ConfigError, match=match):
        spawn(lambda backend: TensorParallelModel(build(), backend, plan=plan), world, timeout=30)


class Branches(nn.Module):
    """``fc_in`` and ``fc_out`` side by side, not in a chain: a plan that splits them column-then-row
    feeds ``fc_out`` the full-width input where it expects ``fc_in``'s split output."""

    def __init__(self):
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc_in(x) + self.fc_out(x)


class Chain(nn.Module):
    """Two column layers in a chain: the second gets the first's split output (``a`` stays split
    because its sibling ``c`` is a row layer) where it expects the full width."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


@pytest.mark.parametrize("build,plan,match", [
    (Branches, {"fc_in": "column", "fc_out": "row"},
     r"'fc_out' \(row\) expects its input split over the 2 tensor ranks \(last dim 4 of 8\) but got the "
     r"full width 8: in the forward it must take its 'column' sibling's output"),
    (Chain, {"a": "column", "b": "column", "c": "row"},
     r"'b' \(column\) expects the full input width 8 but got 4, one rank's slice"),
])
def test_a_plan_wired_against_the_forward_names_the_layer(build, plan, match):
    """A plan whose styles do not match how the forward connects the layers fails with an error
    that names the planned layer and what it got, before any collective (every tensor rank sees
    the same shapes), instead of torch's 'mat1 and mat2 shapes cannot be multiplied'."""
    def worker(backend):
        model = TensorParallelModel(build().double(), backend, plan=plan)
        model(torch.zeros(3, 8, dtype=torch.float64))

    with pytest.raises(ValueError, match=match):
        spawn(worker, 2, timeout=30)


def test_a_plan_naming_the_model_itself_says_to_wrap_it():
    """``{"": "column"}`` on a bare nn.Linear passed the checks ('' is in named_modules()), then
    registered the parallel layer as a child of the dense one and failed with a KeyError."""
    with pytest.raises(ConfigError, match=r"plan names the model itself.*nn.Sequential\(layer\) "
                                          r"with plan \{'0': 'column'\}"):
        spawn(lambda backend: TensorParallelModel(nn.Linear(4, 6), backend, plan={"": "column"}), 2,
              timeout=30)
