"""HybridShardedModel(data_parallel="zero1"/"zero2") takes in-place edits of its parameters made
after wrapping (pretrained weights loaded into ``model.module``, ``p.mul_(0.5)`` between steps) into
its master chunks before the optimizer steps, as ZeRO1Model/ZeRO2Model do. The first step used to
write the old master chunk back over the edited weights (0.92 from one process on a small MLP);
training now goes on from the edited values as one process would (float64, 1e-10)."""
from __future__ import annotations

import pytest
import torch

from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models import HybridShardedModel
from distframe.optimizers import ZeRO1Optimizer, ZeRO2Optimizer
from tests.models.common import lm_loss, tiny_lm

OPTIMIZERS = {"zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}
HALVED = ("tok_embedding.weight", "blocks.1.mlp.fc_in.weight")  # the tied weight and one stage's own
PRETRAINED = tiny_lm(seed=7).state_dict()


def _batches(steps=3):
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 256, (4, 16), generator=g))
            for _ in range(steps)]


def _slice(batch, index, dp=2):
    per = batch[0].shape[0] // dp
    return batch[0][index * per:(index + 1) * per], batch[1][index * per:(index + 1) * per]


def _halve(named):
    """The in-place edit between steps, on every rank holding the parameter (both stages hold the
    tied one)."""
    with torch.no_grad():
        for name, p in named:
            if name in HALVED:
                p.mul_(0.5)


def _one_process(edit=_halve):
    model = tiny_lm()
    model.load_state_dict(PRETRAINED)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, (x, y) in enumerate(_batches()):
        if step == 1:
            edit(model.named_parameters())
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _load_pretrained(model):
    if model.dims.pp == 1:  # model.module is the whole model
        model.module.load_state_dict(PRETRAINED)
        return
    with torch.no_grad():  # model.module is this rank's stage: its parameters by their dense names
        for name, p in model.dense_named_parameters():
            p.copy_(PRETRAINED[name])


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("data_parallel", ["zero1", "zero2"])
def test_edits_after_wrapping_are_trained_from(data_parallel, pp):
    check_trained_from(_halve, data_parallel, pp)


def check_trained_from(edit, data_parallel, pp):
    """``edit`` (of ``(name, parameter)`` pairs) between steps 1 and 2 on every rank of a hybrid
    ZeRO model at dp 2 equals the same edit in one process (float64, 1e-10)."""
    dims = ParallelDims(dp=2, pp=pp)

    def run(b):
        model = HybridShardedModel(tiny_lm(), b, dims=dims, num_microbatches=2, data_parallel=data_parallel)
        opt = OPTIMIZERS[data_parallel](model, torch.optim.AdamW, lr=1e-2)
        _load_pretrained(model)
        for step, batch in enumerate(_batches()):
            if step == 1:
                edit(model.dense_named_parameters())
            model.train_step(_slice(batch, model.groups.dp_index), lm_loss, opt)
        return model.gather_full_parameters()

    expected = _one_process(edit)
    for full in spawn(run, 2 * pp, timeout=120):
        for name, tensor in expected.items():
            torch.testing.assert_close(full[name], tensor, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("data_parallel", ["zero1", "zero2"])
def test_an_edit_after_synchronize_gradients_is_stepped_from(data_parallel):
    # A hand-written loop: the step's own synchronize_gradients() does nothing more, but still
    # takes the edit made after the explicit one.
    def run(b):
        model = HybridShardedModel(tiny_lm(), b, dims=ParallelDims(dp=2), data_parallel=data_parallel)
        opt = OPTIMIZERS[data_parallel](model, torch.optim.AdamW, lr=1e-2)
        model.module.load_state_dict(PRETRAINED)
        for step, batch in enumerate(_batches()):
            x, y = _slice(batch, b.rank)
            lm_loss(model(x), y).backward()
            model.synchronize_gradients()
            if step == 1:
                _halve(model.dense_named_parameters())
            opt.step()
            opt.zero_grad()
        return model.gather_full_parameters()

    model = tiny_lm()
    model.load_state_dict(PRETRAINED)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, (x, y) in enumerate(_batches()):
        lm_loss(model(x), y).backward()
        if step == 1:
            _halve(model.named_parameters())
        opt.step()
        opt.zero_grad()
    expected = model.state_dict()
    for full in spawn(run, 2, timeout=120):
        for name, tensor in expected.items():
            torch.testing.assert_close(full[name], tensor, rtol=1e-10, atol=1e-10, msg=name)
