"""HybridShardedModel.zero_grad(set_to_none=False) keeps gradients as zeros, as one process (and
DDPModel) does, so with find_unused_parameters=True AdamW still steps a parameter that ran in an
earlier step only (weight decay and momentum move it)."""
import functools

import torch
from torch import nn

from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models import HybridShardedModel
from tests.models.test_unused_parameters import assert_matches, batches, make_model


def reference(data):
    """One process: AdamW steps, clearing with zero_grad(set_to_none=False); the state dict after
    ``data`` (also the reference of test_zero_grad's DDP case)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for step, (x, y) in enumerate(data):
        nn.functional.mse_loss(model(x, use_spare=step == 0), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return model.state_dict()


def run(backend, data, clear_model):
    model = HybridShardedModel(make_model(), backend, dims=ParallelDims(dp=2), find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for step, (x, y) in enumerate(data):
        xs, ys = x.chunk(2)[backend.rank], y.chunk(2)[backend.rank]
        nn.functional.mse_loss(model(xs, use_spare=step == 0), ys).backward()
        model.synchronize_gradients()
        opt.step()
        (model if clear_model else opt).zero_grad(set_to_none=False)
    return model.gather_full_parameters()


def test_set_to_none_false_keeps_zero_gradients_that_adamw_steps():
    # `spare` runs in step 0 only: its zero gradient in steps 1 and 2 must reach AdamW (0.06 off
    # after three steps when the model's zero_grad set it to None).
    data = batches(3, 12)
    expected = reference(data)
    for clear_model in (False, True):
        assert_matches(spawn(functools.partial(run, data=data, clear_model=clear_model), 2), expected)
