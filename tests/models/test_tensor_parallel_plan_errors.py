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
