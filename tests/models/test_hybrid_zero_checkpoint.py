"""Optimizer state of ZeRO data parallelism inside a pipeline, saved and resumed. The tiny LM's
embedding is tied to its head, which sits on the last stage: both stages hold the weight, and
under ZeRO both wrote its Adam state into the checkpoint (pieces at clashing offsets), so the
checkpoint loaded under no layout ("The size of tensor a (3832) must match the size of tensor b
(376)"). Each range is written by one rank now, as the parameters' are; resumed under the same
layout or under DDP, training goes on as one process would (float64, 1e-10)."""
from __future__ import annotations

import pytest
import torch

from distframe import checkpoint
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models.ddp import DDPModel
from distframe.models.hybrid import HybridShardedModel
from distframe.optimizers import ZeRO1Optimizer, ZeRO2Optimizer
from tests.models.common import lm_loss, tiny_lm

OPTIMIZERS = {"zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}


def _batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 256, (4, 16), generator=g))
            for _ in range(2)]


def _slice(batch, index, dp):
    per = batch[0].shape[0] // dp
    return batch[0][index * per:(index + 1) * per], batch[1][index * per:(index + 1) * per]


def _adamw(named, groups):
    """AdamW over ``named`` parameters; ``groups``: weight decay on the matrices only, as a user
    builds it (two param groups; no decay for norms, biases and the 1-D positions)."""
    named = list(named)
    if not groups:
        return torch.optim.AdamW([p for _, p in named], lr=1e-2)
    decay = [p for name, p in named if p.dim() > 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": [p for _, p in named if p.dim() <= 1], "weight_decay": 0.0}], lr=1e-2)


def _one_process(groups=False):
    model = tiny_lm()
    opt = _adamw(model.named_parameters(), groups)
    for x, y in _batches():
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


# groups: a ZeRO optimizer built from an AdamW instance with two param groups cut its shards into
# pieces whose layout lost which ranges each rank writes, so both stages wrote the tied weight's
# state again (and two tensor ranks each replicated parameter's).
@pytest.mark.parametrize("data_parallel, tp, groups", [("zero1", 1, False), ("zero2", 1, False),
                                                       ("zero1", 2, False), ("zero2", 1, True),
                                                       ("zero1", 2, True)])
def test_zero_inside_a_pipeline_resumes_with_its_optimizer_under_any_layout(tmp_path, data_parallel, tp, groups):
    dims = ParallelDims(dp=2, tp=tp, pp=2)
    first, second = _batches()

    def hybrid(b):
        model = HybridShardedModel(tiny_lm(), b, dims=dims, num_microbatches=2, data_parallel=data_parallel)
        return model, OPTIMIZERS[data_parallel](model, _adamw(model.dense_named_parameters(), groups))

    def save(b):
        model, opt = hybrid(b)
        model.train_step(_slice(first, model.groups.dp_index, 2), lm_loss, opt)
        checkpoint.save(tmp_path / "ckpt", model, opt, step=1)
        return set(opt.state_dict()["tensors"])

    def resume_hybrid(b):
        model, opt = hybrid(b)
        checkpoint.load(tmp_path / "ckpt", model, opt)
        model.train_step(_slice(second, model.groups.dp_index, 2), lm_loss, opt)
        return model.gather_full_parameters()

    def resume_ddp(b):
        model = DDPModel(tiny_lm(), b)
        opt = _adamw(model.wrapped_model.named_parameters(), groups)
        checkpoint.load(tmp_path / "ckpt", model, opt)
        model.train_step(_slice(second, b.rank, 2), lm_loss, opt)
        return model.gather_full_parameters()

    world = dims.dp * dims.tp * dims.pp
    written = spawn(save, world, timeout=60)
    twice = [key for i, keys in enumerate(written) for key in keys & set().union(*written[:i])]
    assert not twice, f"written by two ranks: {twice[:3]}"
    expected = _one_process(groups)
    for full in spawn(resume_hybrid, world, timeout=60) + spawn(resume_ddp, 2, timeout=60):
        for name, tensor in expected.items():
            torch.testing.assert_close(full[name], tensor, rtol=1e-10, atol=1e-10, msg=name)
