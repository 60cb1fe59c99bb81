"""Which 'column' layers keep their output split. A column planned beside a 'row' layer used to
stay split whatever took its output, so a classifier head after an MLP returned each rank's slice
of the logits (half the classes at tp=2) and a different loss on each rank, silently. In an
nn.Sequential the order pairs a column with the row after it; in another module a split output
that reaches the model's output is a ConfigError at the first forward."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import TensorParallelModel
from tests.models.common import SEED_LOCK


def sequential() -> nn.Module:
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 6), nn.Tanh(),
                             nn.Linear(6, 4), nn.Linear(4, 6)).double()


# An MLP then a head; a column -> row pair after a column; two columns in a row, then a row.
PLANS = [{"0": "column", "2": "row", "3": "column"},
         {"0": "column", "2": "row", "3": "column", "5": "row", "6": "column"},
         {"0": "column", "2": "column", "3": "row"}]


@pytest.mark.parametrize("plan", PLANS, ids=["mlp-head", "two-pairs-head", "column-column-row"])
def test_a_sequential_pairs_each_column_with_the_row_after_it(plan):
    dense = sequential()
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 5, 2, 1, 3])
    model = copy.deepcopy(dense)
    opt = torch.optim.SGD(dense.parameters(), lr=0.5)
    loss = F.cross_entropy(dense(x), y)
    loss.backward()
    opt.step()

    def run(backend):
        tp = TensorParallelModel(copy.deepcopy(model), backend, plan=plan)
        out = tp(x).detach()
        got = tp.train_step((x, y), F.cross_entropy, torch.optim.SGD(tp.parameters(), lr=0.5))
        return out, got, tp.gather_full_parameters()

    for out, got, params in spawn(run, 2):
        torch.testing.assert_close(out, model(x), rtol=0, atol=1e-12)
        assert abs(got - loss.item()) < 1e-12
        for name, value in dense.state_dict().items():  # one SGD step: the gradients were exact
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-12)


class Classifier(nn.Module):
    """An MLP's column -> row pair and a head, siblings in one (non-Sequential) module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_in, self.fc_out, self.head = nn.Linear(4, 8), nn.Linear(8, 4), nn.Linear(4, 6)

    def forward(self, x):
        return self.head(x + self.fc_out(torch.relu(self.fc_in(x))))


def test_a_split_output_reaching_the_models_output_is_a_config_error():
    """Without grad too: the first forward of a model only evaluated (or evaluated before it
    trains) was not checked, there being no graph to walk, and returned each rank's slice of the
    logits. Now its ops are followed instead (tensor_parallel_mixing)."""
    plan = {"fc_in": "column", "fc_out": "row", "head": "column"}

    def run(backend):
        model = TensorParallelModel(Classifier().double(), backend, plan=plan)
        for grad in (False, True):
            with torch.set_grad_enabled(grad), pytest.raises(
                    ConfigError, match=r"plan\['head'\]='column' is paired with a 'row' layer.*"
                                       r"reaches the model's output.*Move the layer"):
                model(torch.zeros(3, 4, dtype=torch.float64))
        return [m.output_node for m in model.wrapped_model.modules() if hasattr(m, "output_node")]

    for nodes in spawn(run, 2):
        assert nodes and all(node is None for node in nodes)  # no graph kept once checked


def test_a_column_row_pair_inside_a_module_passes_the_check_and_stops_recording():
    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc_in, self.fc_out = nn.Linear(4, 8), nn.Linear(8, 4)

        def forward(self, x):
            return self.fc_out(torch.relu(self.fc_in(x)))

    def run(backend):
        model = TensorParallelModel(Mlp().double(), backend, plan={"fc_in": "column", "fc_out": "row"})
        model(torch.ones(3, 4, dtype=torch.float64)).sum().backward()
        return [(m.record_output, m.output_node) for m in model.wrapped_model.modules()
                if hasattr(m, "record_output")]

    for recorded in spawn(run, 2):
        assert recorded == [(False, None), (False, None)]
