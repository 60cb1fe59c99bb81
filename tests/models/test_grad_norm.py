"""clip_grad_norm_ on every strategy equals torch.nn.utils.clip_grad_norm_ on the unwrapped model
trained on the whole batch: the same norm each step and the same parameters (float64, 1e-10)."""
from __future__ import annotations

import math

import pytest
import torch

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models.hybrid import HybridShardedModel
from tests.models.common import (SETTINGS, STRATEGIES, build_model, global_batches, lm_loss, loss_fn,
                                 rank_slice, tiny_lm)

TOL = dict(rtol=1e-10, atol=1e-10)
MAX_NORM = 0.3  # below every step's norm in these runs, so each step clips


def reference(model, batches, loss, norm_type):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    norms = []
    for x, y in batches:
        loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)))
        opt.step()
        opt.zero_grad()
    assert min(norms) > MAX_NORM  # every step clips, so a wrong norm shows in the parameters
    return norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_steps(model, opt, batches, loss, norm_type):
    norms = []
    for batch in batches:
        model.forward_backward(batch, loss)
        norms.append(float(model.clip_grad_norm_(MAX_NORM, norm_type)))
        opt.step()
        opt.zero_grad()
    return norms, model.gather_full_parameters()


def check(results, expected_norms, expected_params):
    for norms, params in results:
        assert norms == pytest.approx(expected_norms, rel=1e-12)
        for name, value in expected_params.items():
            torch.testing.assert_close(params[name], value, **TOL, msg=name)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_data_parallel_clip_equals_the_whole_model(strategy, world_size, norm_type):
    batches = global_batches(3, 12)

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        mine = [rank_slice(b, backend.rank, backend.world_size) for b in batches]
        return run_steps(model, opt, mine, loss_fn, norm_type)
    check(spawn(run, world_size, timeout=30), *reference(build_model(), batches, loss_fn, norm_type))


def lm_batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 256, (8, 16), generator=g), torch.randint(0, 256, (8, 16), generator=g))
            for _ in range(2)]


@pytest.mark.parametrize("dims,data_parallel", [
    ((2, 1, 1), "ddp"), ((1, 2, 1), "ddp"), ((1, 1, 2), "ddp"), ((2, 2, 2), "ddp"),
    ((2, 2, 1), "zero1"), ((2, 1, 2), "zero2"), ((2, 2, 2), "zero2")])
def test_hybrid_clip_equals_the_whole_model(dims, data_parallel):
    # The tied embedding and head, LayerNorms replicated over the tensor group and replicas over
    # the data-parallel group must each count once in the norm.
    dp, tp, pp = dims

    def run(backend):
        model = HybridShardedModel(tiny_lm(), backend, dims=ParallelDims(dp=dp, tp=tp, pp=pp),
                                   num_microbatches=2, data_parallel=data_parallel)
        if data_parallel == "ddp":
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        else:
            from distframe.optimizers import ZeRO1Optimizer, ZeRO2Optimizer
            opt = (ZeRO1Optimizer if data_parallel == "zero1" else ZeRO2Optimizer)(
                model, torch.optim.Adam, lr=1e-2)
        index = model.groups.dp_index
        mine = [rank_slice(b, index, dp) for b in lm_batches()]
        return run_steps(model, opt, mine, lm_loss, 2.0)
    check(spawn(run, dp * tp * pp, timeout=60), *reference(tiny_lm(), lm_batches(), lm_loss, 2.0))


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_train_step_clips_with_max_grad_norm(strategy):
    batches = global_batches(3, 12)

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        for batch in batches:
            model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt,
                             max_grad_norm=MAX_NORM)
        return model.gather_full_parameters()
    _, expected = reference(build_model(), batches, loss_fn, 2.0)
    for params in spawn(run, 2, timeout=30):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, **TOL, msg=name)


def test_bad_max_norm_is_a_config_error():
    def run(backend):
        model = STRATEGIES["ddp"][0](build_model(), backend)
        with pytest.raises(ConfigError, match="max_norm"):
            model.clip_grad_norm_(-1.0)
        with pytest.raises(ConfigError, match="norm_type"):
            model.clip_grad_norm_(1.0, norm_type=0)
    spawn(run, 1)
