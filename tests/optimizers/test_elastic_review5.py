"""ElasticOptimizer, ElasticController and owned lr schedulers (in-memory engine, float64):
a model-parallel model is refused (local_slice gave ranks of one tensor or pipeline group
different rows); a scheduled membership change survives a failure right after its commit (the
next group looked only for later changes); a plain optimizer's checkpoint loaded by hand resumes
at its step; a scheduler built on another optimizer is refused (its rate never moved)."""
import copy
import threading
import types

import pytest
import torch
from torch import nn

from distframe import checkpoint, spawn
from distframe.errors import ConfigError
from distframe.mesh import ParallelDims
from distframe.models import (DDPModel, HybridShardedModel, PipelineParallelModel, TensorParallelModel,
                              ZeRO2Model)
from distframe.optimizers import ZeRO2Optimizer
from distframe.optimizers.async_sgd import AsyncSGDOptimizer
from distframe.optimizers.elastic import ElasticOptimizer
from distframe.optimizers.elastic_membership import ElasticController
from distframe.optimizers.owned_scheduler import build_scheduler
from tests.models.common import SEED_LOCK
from tests.optimizers.elastic_reference import adam_reference

with SEED_LOCK:
    torch.manual_seed(11)
    MLP = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2)).double()
GLOBAL_BATCH = 12  # divisible by every world size below
LR = 0.01
StepLR = torch.optim.lr_scheduler.StepLR


def _global_batch(step):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=torch.float64)
    return x, torch.stack([x[:, 0].sin(), x[:, 1] * x[:, 2]], dim=1)


def _max_diff(params, reference):
    return max((params[k] - v).abs().max().item() for k, v in reference.items())


MODEL_PARALLEL = {
    "tensor": lambda b: TensorParallelModel(copy.deepcopy(MLP), b, plan={"0": "column", "2": "row"}),
    "pipeline": lambda b: PipelineParallelModel(copy.deepcopy(MLP), b, num_microbatches=2),
    "hybrid": lambda b: HybridShardedModel(copy.deepcopy(MLP), b, dims=ParallelDims(dp=1, tp=2, pp=1),
                                           tp_plan={"0": "column", "2": "row"}),
}


@pytest.mark.parametrize("kind", sorted(MODEL_PARALLEL))
def test_a_model_parallel_model_is_refused_at_construction(kind):
    """Before, it was accepted and local_slice split the batch over tensor/pipeline ranks that
    must share one slice: 0.06 away from the single-process run after 4 Adam steps."""
    def fn(b):
        ElasticOptimizer(MODEL_PARALLEL[kind](b), torch.optim.Adam, lr=LR)

    with pytest.raises(ConfigError, match=r"ElasticOptimizer supports only data-parallel models \(DDPModel, "
                                          r"ZeRO1Model, ZeRO2Model, ZeRO3Model, FSDPModel\), got \w+Model"):
        spawn(fn, 2, timeout=30)


@pytest.mark.parametrize(("initial", "schedule"), [(2, {3: 4}), (3, {3: 1})], ids=["grow", "shrink"])
def test_a_scheduled_change_survives_a_failure_after_its_commit(initial, schedule):
    """Worker 1 commits step 3 (the scheduled step) with its group, then fails. The change is
    made all the same: the next group has the scheduled size from step 3 on, and the run equals
    the uninterrupted one (before, it went on one member fewer and never resized)."""
    total = 5
    failed = threading.Event()

    def worker(backend, member):
        model = DDPModel(copy.deepcopy(MLP), backend)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, member=member)
        while opt.step_count < total and not opt.membership_changes:
            model.train_step(opt.local_slice(_global_batch(opt.step_count)), nn.functional.mse_loss, opt)
        if member.worker_id == 1 and opt.step_count == 3 and not failed.is_set():
            failed.set()
            raise RuntimeError("worker 1 died after committing step 3")
        return opt.step_count, backend.world_size, model.gather_full_parameters()

    generations = ElasticController(worker, initial_world=initial, schedule=schedule, timeout=30).run()
    size = schedule[3]
    assert [(len(g.members), g.start_step, g.end) for g in generations] == [
        (initial, 0, "failed"), (size, 3, "finished")]
    assert generations[0].failed_worker == 1
    reference = adam_reference(MLP, LR, range(total), _global_batch)
    for step, world, params in generations[-1].results:
        assert (step, world) == (total, size)
        assert _max_diff(params, reference) <= 1e-10


# A plain optimizer's checkpoint holds no step count of its own: the checkpoint's step is used.
def test_a_plain_checkpoint_loaded_by_hand_resumes_at_its_step(tmp_path):
    def save(b):
        model = ZeRO2Model(copy.deepcopy(MLP), b)
        opt = ZeRO2Optimizer(model, torch.optim.Adam, lr=LR)
        for step in range(5):
            n = GLOBAL_BATCH // b.world_size
            x, y = _global_batch(step)
            model.train_step((x[b.rank * n:(b.rank + 1) * n], y[b.rank * n:(b.rank + 1) * n]),
                             nn.functional.mse_loss, opt)
        checkpoint.save(tmp_path / "step-5", model, opt, step=5)

    def load(b):
        model = ZeRO2Model(copy.deepcopy(MLP), b)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR)
        checkpoint.load(tmp_path / "step-5", model, opt)
        return opt.step_count, opt.member.commit.step

    spawn(save, 2, timeout=30)
    assert spawn(load, 3, timeout=30) == [(5, 5)] * 3


def _another_optimizer():
    return torch.optim.SGD(copy.deepcopy(MLP).parameters(), lr=0.1)


def test_build_scheduler_refuses_one_built_on_another_optimizer():
    mine, other = _another_optimizer(), _another_optimizer()
    with pytest.raises(ConfigError, match=r"Owner lr_scheduler built StepLR on another optimizer \(SGD\), "
                                          r"whose rates Owner never uses; build it on the optimizer passed"):
        build_scheduler(lambda opt: StepLR(other, 1, 0.1), mine, "Owner")
    assert build_scheduler(lambda opt: StepLR(opt, 1, 0.1), mine, "Owner").optimizer is mine
    # A wrapper (a sharded optimizer) and the optimizer it wraps hold the same groups: accepted.
    wrapper = types.SimpleNamespace(param_groups=mine.param_groups)
    assert build_scheduler(lambda opt: StepLR(mine, 1, 0.1), wrapper, "Owner").optimizer is mine


def test_elastic_refuses_a_scheduler_built_on_another_optimizer_and_steps_its_own():
    """Before, StepLR(other, 1, 0.1) was accepted and the rate stayed 0.1 after three steps."""
    def fn(b, on_other):
        model = DDPModel(copy.deepcopy(MLP), b)
        other = torch.optim.SGD(model.module.parameters(), lr=0.1)
        opt = ElasticOptimizer(model, torch.optim.SGD, lr=0.1, lr_scheduler=lambda o: StepLR(
            other if on_other else o, 1, 0.1))
        for step in range(3):
            model.train_step(opt.local_slice(_global_batch(step)), nn.functional.mse_loss, opt)
        return opt.param_groups[0]["lr"]

    with pytest.raises(ConfigError, match="on another optimizer .*build it on the optimizer passed"):
        spawn(lambda b: fn(b, True), 2, timeout=30)
    assert spawn(lambda b: fn(b, False), 2, timeout=30) == pytest.approx([1e-4] * 2, rel=1e-12, abs=0)


def test_async_refuses_a_server_scheduler_built_on_another_optimizer():
    def fn(b):
        other = _another_optimizer()
        AsyncSGDOptimizer(DDPModel(copy.deepcopy(MLP), b), torch.optim.SGD, lr=LR, deterministic=True,
                          lr_scheduler=lambda opt: StepLR(other, 1, 0.1))

    with pytest.raises(ConfigError, match="AsyncSGDOptimizer lr_scheduler built StepLR on another optimizer"):
        spawn(fn, 2, timeout=30)
