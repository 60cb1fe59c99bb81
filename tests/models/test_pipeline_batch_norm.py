"""A pipeline with num_microbatches > 1 normalises BatchNorm by each micro-batch's statistics and
updates the running statistics once per micro-batch (as GPipe and torch.distributed.pipelining
do), so it trains differently from one process on the whole batch: each stage that holds a
BatchNorm warns once, naming it. Checked to be true: the parameters do differ."""
import functools
import warnings

import pytest
import torch
from torch import nn

from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models import HybridShardedModel, PipelineParallelModel
from tests.models.common import SEED_LOCK


def make_model(norm: bool) -> nn.Sequential:
    torch.manual_seed(0)
    middle = nn.BatchNorm1d(6) if norm else nn.LayerNorm(6)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), middle, nn.Linear(6, 2)).double()


def train(backend, norm, micro_batches, hybrid=False):
    with SEED_LOCK:
        dense = make_model(norm)
    if hybrid:
        model = HybridShardedModel(dense, backend, dims=ParallelDims(pp=2), num_microbatches=micro_batches)
    else:
        model = PipelineParallelModel(dense, backend, num_microbatches=micro_batches, split_points=[2])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(8, 2, generator=generator, dtype=torch.float64)
    model.train_step((x, y), nn.functional.mse_loss, opt)
    return {k: v.clone() for k, v in model.gather_full_parameters().items()}


def run(world, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = spawn(functools.partial(train, **kw), world)
    return result[0], [str(w.message) for w in caught if "BatchNorm" in str(w.message)]


def single_process(norm):
    model = make_model(norm)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(8, 2, generator=generator, dtype=torch.float64)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return model.state_dict()


@pytest.mark.parametrize("hybrid", [False, True])
def test_micro_batched_batch_norm_warns_once_naming_it(hybrid):
    params, messages = run(2, norm=True, micro_batches=2, hybrid=hybrid)
    assert len(messages) == 1, messages  # the stage that holds it
    assert "num_microbatches=2" in messages[0] and "'2'" in messages[0] and "BatchNorm1d" in messages[0]
    assert "num_microbatches=1" in messages[0] and "LayerNorm" in messages[0]
    expected = single_process(True)
    assert not torch.allclose(params["3.weight"], expected["3.weight"], atol=1e-6)  # what it warns of


@pytest.mark.parametrize(("norm", "micro_batches"), [(True, 1), (False, 2)])
def test_no_warning_where_the_pipeline_trains_as_one_process(norm, micro_batches):
    params, messages = run(2, norm=norm, micro_batches=micro_batches)
    assert messages == []
    expected = single_process(norm)
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-12)
