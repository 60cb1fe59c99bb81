"""A plain optimizer built over the dense model before a tensor-parallel wrap holds the dense
weights that the plan replaced by slices: train_step would step those orphans (their gradient
stays None) and leave every split layer untrained without a word. It is refused instead, on every
rank; over a pipeline (no parameter replaced) such an optimizer trains as one process does."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models.hybrid import HybridShardedModel
from distframe.models.pipeline import PipelineParallelModel
from distframe.models.tensor_parallel_model import TensorParallelModel
from tests.models.common import SEED_LOCK

PLAN = {"0": "column", "2": "row"}


def _mlp() -> nn.Module:
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)


@pytest.mark.parametrize(("wrap", "world"), [
    (lambda m, b: TensorParallelModel(m, b, plan=PLAN), 2),
    (lambda m, b: HybridShardedModel(m, b, dims=ParallelDims(tp=2, pp=2), tp_plan=PLAN, split_points=[2]), 4),
], ids=["tensor", "hybrid-tp-pp"])
def test_an_optimizer_over_the_replaced_dense_weights_is_refused(wrap, world):
    def run(backend):
        dense = _mlp()
        optimizer = torch.optim.SGD(dense.parameters(), lr=0.1)
        model = wrap(dense, backend)
        with pytest.raises(ConfigError, match=r"after wrapping.*model\.parameters\(\)"):
            model.train_step(_batch(), F.mse_loss, optimizer)
        # Built after wrapping, the same optimizer trains.
        return model.train_step(_batch(), F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    spawn(run, world)


def test_an_optimizer_built_before_a_pipeline_wrap_trains_as_one_process():
    reference = _mlp()
    x, y = _batch()
    F.mse_loss(reference(x), y).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()

    def run(backend):
        dense = _mlp()
        optimizer = torch.optim.SGD(dense.parameters(), lr=0.1)
        model = PipelineParallelModel(dense, backend, num_microbatches=2, split_points=[2])
        model.train_step((x, y), F.mse_loss, optimizer)
        return model.gather_full_parameters()
    for full in spawn(run, 2):
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(full[name], value, rtol=1e-12, atol=1e-12)
