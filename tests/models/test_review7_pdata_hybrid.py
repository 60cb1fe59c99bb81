"""HybridShardedModel(data_parallel="zero1"/"zero2") trains from a parameter whose ``.data`` was
replaced after wrapping (``p.data = p.data * 0.5`` between steps) as one process would, from a
seventh review: the master chunk kept the old values, the optimizer stepped them and its all_gather
wrote them over the new ones (1.90 from one process on a small MLP). Float64, 1e-10."""
from __future__ import annotations

import pytest
import torch

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models import HybridShardedModel
from tests.models.common import lm_loss, tiny_lm
from tests.models.test_hybrid_zero_edits import (HALVED, OPTIMIZERS, PRETRAINED, _batches, _slice,
                                                 check_trained_from)


def _replace(named):
    """``p.data = p.data * 0.5``, on every rank holding the parameter (both stages hold the tied one)."""
    for name, p in named:
        if name in HALVED:
            p.data = p.data * 0.5


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("data_parallel", ["zero1", "zero2"])
def test_a_replaced_data_is_trained_from(data_parallel, pp):
    check_trained_from(_replace, data_parallel, pp)


def test_an_ema_swap_leaves_training_exact():
    ema = tiny_lm(seed=3).state_dict()

    def run(b):
        model = HybridShardedModel(tiny_lm(), b, dims=ParallelDims(dp=2), data_parallel="zero1")
        opt = OPTIMIZERS["zero1"](model, torch.optim.AdamW, lr=1e-2)
        model.module.load_state_dict(PRETRAINED)
        for batch in _batches():
            model.train_step(_slice(batch, b.rank), lm_loss, opt)
            saved = {n: p.data for n, p in model.module.named_parameters()}
            for n, p in model.module.named_parameters():
                p.data = ema[n].clone()
            with torch.no_grad():
                model(batch[0])
            for n, p in model.module.named_parameters():
                p.data = saved[n]
        return model.gather_full_parameters()

    model = tiny_lm()
    model.load_state_dict(PRETRAINED)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in _batches():
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for full in spawn(run, 2, timeout=120):
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(full[name], tensor, rtol=1e-10, atol=1e-10, msg=name)


def test_a_replacement_of_another_shape_is_refused():
    def run(b):
        model = HybridShardedModel(tiny_lm(), b, dims=ParallelDims(dp=2), data_parallel="zero2")
        opt = OPTIMIZERS["zero2"](model, torch.optim.AdamW, lr=1e-2)
        x, y = _slice(_batches(1)[0], b.rank)
        model.train_step((x, y), lm_loss, opt)
        weight = model.module.get_parameter("blocks.1.mlp.fc_in.weight")
        weight.data = torch.zeros(weight.shape[0], weight.shape[1] + 1, dtype=weight.dtype)
        with pytest.raises(ConfigError, match=r"HybridShardedModel.*shape.*copy_"):
            model.synchronize_gradients()
        return True
    assert spawn(run, 2, timeout=60) == [True, True]
