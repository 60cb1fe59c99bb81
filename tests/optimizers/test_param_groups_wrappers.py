"""Param groups of different settings through the optimizers that wrap a data-parallel strategy:
GradientCompressionOptimizer (over DDPModel), ElasticOptimizer (over any of them) and
AsyncSGDOptimizer's server keep an instance's groups as the strategy's own optimizer does, and
train as one process does with the same groups (float64, 1e-10; compression lossless here;
async as its sequential replay), through a checkpoint or a commit."""
from __future__ import annotations

import pytest
import torch

from distframe import checkpoint
from distframe.launch import spawn
from distframe.optimizers import AsyncSGDOptimizer, ElasticOptimizer, GradientCompressionOptimizer
from distframe.optimizers.compression import IdentityCompressor
from tests.models.common import SETTINGS, STRATEGIES, build_model, global_batches, loss_fn
from tests.optimizers.test_param_groups import ADAMW, SGD, STEPS, assert_parameters, grouped, reference, train


def _compressed(backend, spec=ADAMW, seed=0, settings=None):
    model = STRATEGIES["ddp"][0](build_model(seed=seed), backend, **SETTINGS["ddp"])
    opt = GradientCompressionOptimizer(model, grouped(model.module, spec, settings),
                                       compressor=IdentityCompressor())
    return model, opt


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("spec", [ADAMW, SGD], ids=["adamw", "sgd"])
def test_compression_keeps_param_groups(world, spec):
    # It refused an instance whose groups differed (ConfigError naming DDPOptimizer).
    def run(backend):
        model, opt = _compressed(backend, spec)
        assert len(opt.param_groups) == len(spec[2])
        train(backend, model, opt, global_batches(STEPS, 12))
        return model.gather_full_parameters()
    assert_parameters(spawn(run, world, timeout=60), reference(spec=spec)[0])


def test_a_compression_checkpoint_keeps_each_groups_settings(tmp_path):
    path, batches = tmp_path / "ckpt", global_batches(STEPS, 12)

    def save(backend):
        model, opt = _compressed(backend)
        train(backend, model, opt, batches[:STEPS // 2])
        checkpoint.save(path, model, opt, step=STEPS // 2)

    def resume(backend):
        model, opt = _compressed(backend, seed=5, settings={"lr": 0.5, "weight_decay": 0.9})
        checkpoint.load(path, model, opt)
        train(backend, model, opt, batches[STEPS // 2:])
        return model.gather_full_parameters()
    spawn(save, 2, timeout=60)
    assert_parameters(spawn(resume, 3, timeout=60), reference()[0])


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
def test_elastic_keeps_param_groups_across_a_commit(strategy, tmp_path):
    """Half the steps, committed; a new group of workers (another world size) restores the commit
    from the checkpoint it wrote and trains the rest: one process's training with the groups."""
    batches = global_batches(STEPS, 12)

    def run(backend, steps, restored):
        model_cls, _ = STRATEGIES[strategy]
        model = model_cls(build_model(seed=5 if restored else 0), backend, **SETTINGS[strategy])
        settings = {"lr": 0.5, "weight_decay": 0.9} if restored else None
        opt = ElasticOptimizer(model, grouped(model.module, ADAMW, settings), checkpoint_dir=tmp_path,
                               checkpoint_every=1, commit_every=STEPS // 2)
        assert opt.step_count == (STEPS // 2 if restored else 0)
        train(backend, model, opt, steps)
        return model.gather_full_parameters()
    spawn(lambda b: run(b, batches[:STEPS // 2], False), 2, timeout=60)
    assert_parameters(spawn(lambda b: run(b, batches[STEPS // 2:], True), 3, timeout=60), reference()[0])


@pytest.mark.parametrize("staleness_lr", [False, True])
def test_async_server_steps_with_the_groups(staleness_lr):
    """Deterministic, no staleness allowed: sequential SGD over the workers' interleaved batches,
    with the groups' own lr, momentum and weight decay (each lr scaled by 1 / (1 + staleness)
    when asked; staleness is 0 here, so that changes nothing), bitwise."""
    batches = global_batches(3 * 2, 4)
    model = build_model()
    opt = grouped(model, SGD)
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    expected = {n: p.detach() for n, p in model.named_parameters()}

    def run(backend):
        model = STRATEGIES["ddp"][0](build_model(), backend)
        opt = AsyncSGDOptimizer(model, grouped(model.module, SGD), max_staleness=0, deterministic=True,
                                staleness_lr=staleness_lr)
        if opt.is_server:
            opt.serve()
            return {n: p.detach().clone() for n, p in model.wrapped_model.named_parameters()}
        for k in range(3):  # worker w takes batches w - 1, w + 1, ... (round robin over 2 workers)
            opt.train_step(batches[2 * k + backend.rank - 1], loss_fn)
        opt.finish()
        return None
    server, *_ = spawn(run, 3, timeout=60)
    for name, value in expected.items():
        assert torch.equal(server[name], value), name
