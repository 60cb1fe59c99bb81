"""HybridShardedModel when the user drives backward: two backward passes over one forward
(``retain_graph=True``), each followed by ``synchronize_gradients``, add up as in one process
(float64, 1e-10), under every data-parallel flavour, with and without tensor parallelism."""
from __future__ import annotations

import pytest
import torch

from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models.hybrid import HybridShardedModel
from tests.models.common import lm_loss, tiny_lm
from tests.models.test_hybrid import TOL, batches, dp_slice

LR = 0.1


def _two_losses(logits, targets):
    """Two losses of one output, so the second backward's gradients differ from the first's."""
    return lm_loss(logits, targets), logits.square().mean()


def _dense_step():
    """One process over the whole batch: backward of each loss, then one SGD step."""
    model = tiny_lm()
    x, y = batches()[0]
    first, second = _two_losses(model(x), y)
    first.backward(retain_graph=True)
    second.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return model.state_dict()


def _optimizer(model, data_parallel):
    from distframe.optimizers import ZeRO1Optimizer, ZeRO2Optimizer
    if data_parallel == "ddp":
        return torch.optim.SGD(model.parameters(), lr=LR)
    return (ZeRO1Optimizer if data_parallel == "zero1" else ZeRO2Optimizer)(model, torch.optim.SGD, lr=LR)


@pytest.mark.parametrize("dims", [ParallelDims(dp=2), ParallelDims(dp=2, tp=2), ParallelDims(dp=4)],
                         ids=["dp2", "dp2-tp2", "dp4"])
@pytest.mark.parametrize("data_parallel", ["ddp", "zero1", "zero2"])
def test_second_backward_over_one_forward_is_synchronised(dims, data_parallel):
    # synchronize_gradients after the first backward made the second call a no-op until the next
    # forward: each replica kept its own second gradient (ZeRO-2 dropped it), and the replicas'
    # parameters drifted apart after the step.
    def run(b):
        model = HybridShardedModel(tiny_lm(), b, dims=dims, data_parallel=data_parallel)
        opt = _optimizer(model, data_parallel)
        x, y = dp_slice(batches()[0], model.groups.dp_index, dims.dp)
        first, second = _two_losses(model(x), y)
        first.backward(retain_graph=True)
        model.synchronize_gradients()
        second.backward()
        model.synchronize_gradients()
        opt.step()
        return model.gather_full_parameters()

    expected = _dense_step()
    for full in spawn(run, dims.world_size):
        for name, tensor in expected.items():
            torch.testing.assert_close(full[name], tensor, **TOL, msg=name)
