"""An optimizer step after backward passes that all ran inside ``no_sync()`` (the last micro-batch of
an accumulation loop under no_sync too) averages what they accumulated, as the synchronising
backward would have: one process's step on the whole accumulated batch. It was accepted silently:
DDP stepped each rank's own gradient (replicas 0.1 apart), ZeRO-1/2/3 and FSDP stepped without the
gradients (only AdamW's weight decay moved the weights, 0.052 off one process). float64, 1e-10."""
from __future__ import annotations

import functools

import pytest
import torch

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import DDPModel, MixedPrecisionPolicy
from tests.models.common import (SETTINGS, STRATEGIES, build_model, global_batches, loss_fn, rank_slice)

TOL = dict(rtol=0, atol=1e-10)
K, WORLD, MICRO = 3, 2, 4
DATA = global_batches(2, K * WORLD * MICRO)


def reference(steps=2, lr=1e-2):
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    for x, y in DATA[:steps]:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _accumulate(model, batch, rank, *, step):
    """Every micro-batch of this rank under no_sync; its rows so that all ranks' make ``batch``."""
    for j in range(K):
        x, y = rank_slice(batch, j * WORLD + rank, K * WORLD)
        with model.no_sync():
            (loss_fn(model(x), y) / K).backward()
    step()


def run(backend, strategy, how, settings=None):
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(build_model(), backend, **SETTINGS[strategy], **(settings or {}))
    if how == "plain":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        opt = opt_cls(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    def clipped_step():  # clip_grad_norm_ synchronises first: the same average, clipped by its norm
        model.clip_grad_norm_(1e6)
        opt.step()

    for batch in DATA:
        _accumulate(model, batch, backend.rank, step=clipped_step if how == "clip" else opt.step)
        opt.zero_grad()
    return model.gather_full_parameters()


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_a_step_after_backwards_all_under_no_sync_trains_as_one_process(strategy):
    expected = reference()
    for params in spawn(functools.partial(run, strategy=strategy, how="sharded"), WORLD, timeout=60):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, **TOL, msg=name)


@pytest.mark.parametrize("strategy, how", [("ddp", "plain"), ("ddp", "clip"), ("fsdp", "clip"),
                                           ("zero2", "clip")])
def test_a_plain_optimizer_or_clipping_after_no_sync_trains_as_one_process(strategy, how):
    expected = reference()
    for params in spawn(functools.partial(run, strategy=strategy, how=how), WORLD, timeout=60):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, **TOL, msg=name)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
@pytest.mark.filterwarnings("ignore:in-memory ranks .* share this rank's GPU")
def test_a_step_after_no_sync_where_the_average_is_deferred(strategy):
    def sharing(backend):
        peers = [r for r in range(backend.world_size) if r != backend.rank]
        backend.peers_sharing_autograd_thread = lambda: peers
        return run(backend, strategy, "sharded")

    expected = reference()
    for params in spawn(sharing, WORLD, timeout=60):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, **TOL, msg=name)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_step_after_no_sync_on_gloo(strategy):
    expected = reference()
    for params in spawn(functools.partial(run, strategy=strategy, how="sharded"), WORLD, backend="gloo",
                        timeout=60):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, **TOL, msg=name)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp"])
def test_no_sync_accumulation_in_reduce_dtype_reaches_the_step(strategy):
    # A reduce_dtype finer than the compute dtype keeps no_sync's sum apart from .grad (GradientBuckets'
    # and ShardedUnit's ``accumulated``): that sum is what the step averages. float32 sums of float64.
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    expected = reference()
    for params in spawn(functools.partial(run, strategy=strategy, how="sharded",
                                          settings={"mixed_precision": policy}), WORLD, timeout=60):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("clear", ["model", "optimizer"])
def test_gradients_cleared_after_no_sync_are_not_stepped(strategy, clear):
    # zero_grad() discards what no_sync accumulated: the step then has no gradient to take (AdamW
    # skips a parameter whose .grad is None), and communicates nothing.
    def run_cleared(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        before = model.gather_full_parameters()
        x, y = rank_slice(DATA[0], backend.rank, WORLD)
        with model.no_sync():
            loss_fn(model(x), y).backward()
        (model if clear == "model" else opt).zero_grad()
        backend.stats.reset()
        opt.step()
        sent = backend.stats.calls.get("all_reduce", 0) + backend.stats.calls.get("reduce_scatter", 0)
        return sent, before, model.gather_full_parameters()

    for sent, before, after in spawn(run_cleared, WORLD, timeout=60):
        assert sent == 0
        for name, value in before.items():
            torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=name)


def test_ddp_step_inside_no_sync_steps_local_gradients():
    # Inside no_sync nothing is communicated, the step included (torch DDP's meaning, which
    # AsyncSGDOptimizer's workers rely on): each rank steps its own gradient.
    def run_inside(backend):
        model = DDPModel(build_model(), backend, **SETTINGS["ddp"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = rank_slice(DATA[0], backend.rank, WORLD)
        with model.no_sync():
            loss_fn(model(x), y).backward()
            backend.stats.reset()
            opt.step()
            return sum(backend.stats.calls.values())

    assert spawn(run_inside, WORLD, timeout=60) == [0, 0]


def _scaled(backend, scaler_cls):
    # A GradScaler checks the gradients for inf before the step: after backward passes all under
    # no_sync they are each rank's own, so a plain GradScaler's check need not agree across ranks
    # (a rank that skipped its step would leave its peers in the step's all_reduce).
    from distframe import ShardedGradScaler
    from distframe.optimizers import DDPOptimizer
    model = DDPModel(build_model(), backend, **SETTINGS["ddp"])
    opt = DDPOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    scaler = (ShardedGradScaler("cpu", init_scale=2.0 ** 8) if scaler_cls == "sharded"
              else torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))
    try:
        for batch in DATA:
            for j in range(K):
                x, y = rank_slice(batch, j * WORLD + backend.rank, K * WORLD)
                with model.no_sync():
                    scaler.scale(loss_fn(model(x), y) / K).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    except ConfigError as exc:
        return str(exc)
    return model.gather_full_parameters()


def test_a_sharded_grad_scaler_after_no_sync_trains_as_one_process():
    expected = reference()  # scaling by a power of two is exact in float64
    for params in spawn(functools.partial(_scaled, scaler_cls="sharded"), WORLD, timeout=60):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, **TOL, msg=name)


def test_a_plain_grad_scaler_after_no_sync_is_refused_on_every_rank():
    for message in spawn(functools.partial(_scaled, scaler_cls="plain"), WORLD, timeout=60):
        assert isinstance(message, str) and "ShardedGradScaler" in message, message
        assert "no_sync" in message and "shard" not in message, message
