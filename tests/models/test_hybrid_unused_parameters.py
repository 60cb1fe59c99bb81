"""HybridShardedModel warns, as DDPModel and the ZeRO models do, when a parameter gets no gradient
on a rank and data parallelism will average it as zeros: AdamW's weight decay and moments then
move it where single-process training skips it (1.2e-2 off after four steps at dp=2, no word)."""
import functools
import warnings

import pytest
import torch
from torch import nn

from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models import HybridShardedModel
from distframe.optimizers import ZeRO1Optimizer
from tests.models.test_unused_parameters import batches, make_model


def run(backend, data_parallel, find_unused, dp):
    model = HybridShardedModel(make_model(), backend, dims=ParallelDims(dp=dp), data_parallel=data_parallel,
                               find_unused_parameters=find_unused)
    if data_parallel == "ddp":
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    else:
        opt = ZeRO1Optimizer(model, torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    for step, (x, y) in enumerate(batches(3, 12)):
        x = x.clone()
        x[:, 0] = x[:, 0].abs()  # the gate open on every row: `extra` gets a gradient on each rank
        xs, ys = x.chunk(dp)[backend.rank % dp], y.chunk(dp)[backend.rank % dp]
        nn.functional.mse_loss(model(xs, use_spare=step == 1), ys).backward()
        model.synchronize_gradients()
        opt.step()
        opt.zero_grad()


def warnings_of(world, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spawn(functools.partial(run, **kw), world)
    return [str(w.message) for w in caught if "got no gradient" in str(w.message)]


@pytest.mark.parametrize("data_parallel, fix", [
    ("ddp", "Pass find_unused_parameters=True"),
    ("zero1", "data_parallel='ddp' with find_unused_parameters=True")])
def test_each_rank_warns_once_naming_the_parameters(data_parallel, fix):
    # `spare` runs in step 1 only; every rank sees it without a gradient in steps 0 and 2.
    messages = warnings_of(2, data_parallel=data_parallel, find_unused=False, dp=2)
    assert len(messages) == 2, messages
    assert all(m.startswith("HybridShardedModel: 2 parameter(s) got no gradient") for m in messages)
    assert all("('spare.weight', 'spare.bias')" in m and fix in m for m in messages), messages
    assert {m.split(" on rank ")[1][0] for m in messages} == {"0", "1"}, messages


@pytest.mark.parametrize("find_unused, dp", [(True, 2), (False, 1)])
def test_no_warning_where_their_gradient_stays_none(find_unused, dp):
    # find_unused_parameters leaves .grad None where no rank has one; at dp=1 nothing averages it.
    assert warnings_of(dp, data_parallel="ddp", find_unused=find_unused, dp=dp) == []
