"""Optimizer instances with param groups of different settings (the decay / no-decay split, a lower
lr for the first layer): the sharded optimizers that keep them train as one process does with the
same groups (float64, 1e-10), over any world size, through schedulers and checkpoints."""
from __future__ import annotations

import pytest
import torch

from distframe import checkpoint
from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models import HybridShardedModel
from distframe.optimizers import ShardedGradScaler, ZeRO1Optimizer, ZeRO2Optimizer, build_optimizer
from tests.models.common import SETTINGS, STRATEGIES, build_model, global_batches, loss_fn, rank_slice

GROUPED = list(STRATEGIES)
STEPS = 6

# (which parameters, their settings): every setting differs somewhere, amsgrad and maximize too.
ADAMW = (torch.optim.AdamW, {"lr": 1e-2}, [
    (lambda n, p: n.startswith("0."), {"lr": 3e-3, "weight_decay": 0.3, "betas": (0.7, 0.9)}),
    (lambda n, p: p.dim() > 1, {"weight_decay": 0.1, "betas": (0.8, 0.99)}),
    (lambda n, p: True, {"weight_decay": 0.0, "eps": 1e-6, "amsgrad": True}),
])
SGD = (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}, [
    (lambda n, p: p.dim() > 1, {"weight_decay": 0.1, "nesterov": True}),
    (lambda n, p: True, {"lr": 5e-2, "momentum": 0.5, "dampening": 0.2, "maximize": False}),
])


def grouped(module, spec=ADAMW, settings=None):
    """``spec``'s optimizer over ``module``'s parameters (or over the (name, parameter) pairs
    ``module``), each in the first group that takes it; ``settings`` replaces every group's
    settings (to be overwritten by a load)."""
    cls, defaults, groups = spec
    named = list(module.named_parameters()) if isinstance(module, torch.nn.Module) else list(module)
    taken, param_groups = set(), []
    for takes, group_settings in groups:
        params = [p for n, p in named if id(p) not in taken and takes(n, p)]
        taken.update(id(p) for p in params)
        param_groups.append({"params": params, **(settings or group_settings)})
    return cls(param_groups, **defaults)


def reference(steps=STEPS, spec=ADAMW, schedule=None, max_grad_norm=None):
    model = build_model()
    opt = grouped(model, spec)
    sched = schedule(opt) if schedule else None
    for x, y in global_batches(steps, 12):
        loss_fn(model(x), y).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, [g["lr"] for g in opt.param_groups]


def wrapped(backend, strategy, spec=ADAMW, seed=0, settings=None):
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(build_model(seed=seed), backend, **SETTINGS[strategy])
    return model, opt_cls(model, grouped(model.module, spec, settings))


def train(backend, model, opt, batches, sched=None, **step_settings):
    for batch in batches:
        model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt, **step_settings)
        if sched:
            sched.step()


def assert_parameters(results, expected):
    for params in results:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize("strategy", GROUPED)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("spec", [ADAMW, SGD], ids=["adamw", "sgd"])
def test_param_groups_train_as_one_process_does(strategy, world, spec):
    # DDPOptimizer refused any instance whose groups differed (ConfigError), as ZeRO and FSDP did.
    def run(backend):
        model, opt = wrapped(backend, strategy, spec)
        assert len(opt.param_groups) == len(spec[2])
        train(backend, model, opt, global_batches(STEPS, 12))
        return model.gather_full_parameters()
    assert_parameters(spawn(run, world, timeout=60), reference(spec=spec)[0])


@pytest.mark.parametrize("strategy", GROUPED)
def test_a_scheduler_moves_each_groups_lr(strategy):
    def schedule(opt):
        lambdas = [lambda s: 1 / (1 + s), lambda s: 0.5 ** s, lambda s: 1.0]
        return torch.optim.lr_scheduler.LambdaLR(opt, lambdas)
    expected, lrs = reference(schedule=schedule)

    def run(backend):
        model, opt = wrapped(backend, strategy)
        train(backend, model, opt, global_batches(STEPS, 12), schedule(opt))
        return model.gather_full_parameters(), [g["lr"] for g in opt.param_groups]
    results = spawn(run, 2, timeout=60)
    assert_parameters([params for params, _ in results], expected)
    assert all(got == pytest.approx(lrs, rel=1e-15) for _, got in results)
    assert lrs[0] != lrs[1] != lrs[2]


def _save(path, strategy, world):
    def run(backend):
        model, opt = wrapped(backend, strategy)
        train(backend, model, opt, global_batches(STEPS // 2, 12))
        checkpoint.save(path, model, opt, step=STEPS // 2)
    spawn(run, world, timeout=60)


@pytest.mark.parametrize("strategy", [s for s in GROUPED if s != "ddp"])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_a_sharded_grad_scaler_and_clipping_reach_every_piece(strategy, unscale_first):
    # The pieces' gradients are views of their shard's, taken after every synchronisation: a
    # scaler's unscale and the model's clipping (which write the shards' gradients) reach them.
    # Clipping only after unscale_: clipped by the scaled norm, torch's 1e-6 beside the norm differs.
    expected, _ = reference(max_grad_norm=0.05 if unscale_first else None)

    def run(backend):
        model, opt = wrapped(backend, strategy)
        scaler = ShardedGradScaler("cpu", init_scale=256.0)
        for x, y in (rank_slice(b, backend.rank, backend.world_size) for b in global_batches(STEPS, 12)):
            scaler.scale(loss_fn(model(x), y)).backward()
            if unscale_first:
                scaler.unscale_(opt)
                model.clip_grad_norm_(0.05)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return model.gather_full_parameters()
    assert_parameters(spawn(run, 3, timeout=60), expected)


@pytest.mark.parametrize("strategy", [s for s in GROUPED if s != "ddp"])
def test_groups_cost_no_memory_and_no_communication(strategy):
    # The pieces are views of the shards: the same collectives and the same bytes as one group,
    # but for Adam's step count, a 4-byte scalar per piece.
    decay = (torch.optim.AdamW, {"lr": 1e-2}, [(lambda n, p: p.dim() > 1, {"weight_decay": 0.1}),
                                               (lambda n, p: True, {"weight_decay": 0.0})])

    def run(backend, groups):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        one_group = torch.optim.AdamW(model.parameters())
        opt = opt_cls(model, grouped(model.module, decay) if groups else one_group)
        backend.stats.reset()
        train(backend, model, opt, global_batches(2, 12))
        stats = backend.stats.snapshot()
        x, y = rank_slice(global_batches(1, 12)[0], backend.rank, backend.world_size)
        loss_fn(model(x), y).backward()
        opt.step()
        tensors = sum(len(g["params"]) for g in opt.param_groups)
        return model.memory_footprint(), stats["calls"], stats["bytes"], tensors
    ones, manys = spawn(lambda b: run(b, False), 3), spawn(lambda b: run(b, True), 3)
    assert sum(many[3] for many in manys) > sum(one[3] for one in ones)  # the premise: shards are cut
    for one, many in zip(ones, manys):
        assert many[1:3] == one[1:3]
        extra = {"optimizer_state": 4 * (many[3] - one[3])}
        extra["total"] = extra["optimizer_state"]
        assert many[0] == {k: v + extra.get(k, 0) for k, v in one[0].items()}


@pytest.mark.parametrize("saved, loaded", [
    (("ddp", 2), ("ddp", 3)), (("ddp", 3), ("ddp", 2)), (("ddp", 2), ("zero2", 3)),
    (("zero1", 3), ("zero2", 2)), (("zero2", 2), ("ddp", 3)), (("zero2", 3), ("zero1", 4)),
    (("zero2", 2), ("zero3", 3)), (("zero3", 3), ("fsdp", 2)), (("fsdp", 4), ("ddp", 2))])
def test_a_checkpoint_keeps_each_groups_settings_and_state(tmp_path, saved, loaded):
    path = tmp_path / "ckpt"
    _save(path, *saved)
    expected, _ = reference()
    groups = [settings for _, settings in ADAMW[2]]

    def run(backend):
        # Other values and settings, so that only the load can set them right.
        model, opt = wrapped(backend, loaded[0], seed=5, settings={"lr": 0.5, "weight_decay": 0.9})
        checkpoint.load(path, model, opt)
        settings = [{k: g[k] for k in s} for g, s in zip(opt.param_groups, groups)]
        train(backend, model, opt, global_batches(STEPS, 12)[STEPS // 2:])
        return model.gather_full_parameters(), settings
    for params, settings in spawn(run, loaded[1], timeout=60):
        assert _listed(settings) == _listed(groups)  # betas come back from JSON as a list
        assert_parameters([params], expected)


def _listed(groups):
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]


def test_a_checkpoint_whose_groups_do_not_match_is_refused(tmp_path):
    grouped_path, plain_path = tmp_path / "grouped", tmp_path / "plain"
    _save(grouped_path, "ddp", 2)

    def save_plain(backend):
        model = STRATEGIES["ddp"][0](build_model(), backend)
        opt = STRATEGIES["ddp"][1](model, torch.optim.AdamW, lr=1e-2)
        checkpoint.save(plain_path, model, opt, step=1)
    spawn(save_plain, 2, timeout=30)
    split_otherwise = (torch.optim.AdamW, {"lr": 1e-2},
                       [(lambda n, p: n.startswith("1."), {"lr": 0.1}), (lambda n, p: True, {"lr": 0.2})])

    def load(backend):
        messages = []
        for path, spec in [(grouped_path, split_otherwise), (plain_path, ADAMW)]:
            model, opt = wrapped(backend, "ddp", spec)
            with pytest.raises(ConfigError) as info:
                checkpoint.load(path, model, opt)
            messages.append(str(info.value))
        return messages
    for across, merged in spawn(load, 2, timeout=30):
        assert "with different settings" in across and "param groups" in across
        assert ("param groups [0, 1, 2] train parameters that the checkpoint's optimizer trained "
                "in one param group") in merged
        assert "without the optimizer" in merged


def test_build_optimizer_refuses_groups_it_would_merge():
    # The public helper puts the parameters into one group: groups of different settings would
    # all train with the first one's. Every distframe optimizer keeps them instead.
    model = build_model()
    with pytest.raises(ConfigError, match="2 param groups.*one group.*keeps its groups"):
        build_optimizer(grouped(model, SGD), list(model.parameters()), {}, "test")


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp"])
def test_gradients_accumulated_under_no_sync_reach_the_pieces(strategy):
    expected, _ = reference()

    def run(backend):
        model, opt = wrapped(backend, strategy)
        for batch in global_batches(STEPS, 12):
            x, y = rank_slice(batch, backend.rank, backend.world_size)
            with model.no_sync():
                (loss_fn(model(x[:1]), y[:1]) / 2).backward()
            (loss_fn(model(x[1:]), y[1:]) / 2).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        return model.gather_full_parameters()
    assert_parameters(spawn(run, 6, timeout=60), expected)


@pytest.mark.parametrize("dims,data_parallel", [
    (ParallelDims(dp=2), "zero2"), (ParallelDims(dp=2, pp=2), "zero1"), (ParallelDims(dp=3, pp=2), "zero2")])
def test_a_hybrid_models_zero_optimizer_keeps_param_groups(dims, data_parallel):
    # It refused an instance whose groups differed (ConfigError). Groups are chosen by the
    # unwrapped model's names (dense_named_parameters): a pipeline stage's own names differ.
    opt_cls = STRATEGIES[data_parallel][1]

    def run(backend):
        model = HybridShardedModel(build_model(), backend, dims=dims, data_parallel=data_parallel,
                                   num_microbatches=2)
        opt = opt_cls(model, grouped(model.dense_named_parameters(), ADAMW))
        for batch in global_batches(STEPS, 12):
            model.train_step(rank_slice(batch, model.groups.dp_index, dims.dp), loss_fn, opt)
        return model.gather_full_parameters()
    assert_parameters(spawn(run, dims.world_size, timeout=60), reference()[0])


def _hybrid(backend, seed=0, settings=None):
    dims = ParallelDims(dp=backend.world_size // 2, pp=2)
    model = HybridShardedModel(build_model(seed=seed), backend, dims=dims, data_parallel="zero1",
                               num_microbatches=2)
    return model, ZeRO1Optimizer(model, grouped(model.dense_named_parameters(), ADAMW, settings))


@pytest.mark.parametrize("saved_hybrid", [True, False])
def test_a_checkpoint_of_groups_moves_between_a_hybrid_and_a_zero_model(tmp_path, saved_hybrid):
    path, expected = tmp_path / "ckpt", reference()[0]
    half = global_batches(STEPS, 12)

    def run(backend, hybrid, load):
        make = _hybrid if hybrid else lambda b, **kw: wrapped(b, "zero2", **kw)
        # Loaded into other values and settings, so that only the load can set them right.
        other = {"seed": 5, "settings": {"lr": 0.5, "weight_decay": 0.9}} if load else {}
        model, opt = make(backend, **other)
        if hybrid:
            dp, dp_rank = backend.world_size // 2, model.groups.dp_index
        else:
            dp, dp_rank = backend.world_size, backend.rank
        if load:
            checkpoint.load(path, model, opt)
        for batch in half[STEPS // 2:] if load else half[:STEPS // 2]:
            model.train_step(rank_slice(batch, dp_rank, dp), loss_fn, opt)
        if not load:
            checkpoint.save(path, model, opt, step=STEPS // 2)
        return model.gather_full_parameters()
    spawn(lambda b: run(b, saved_hybrid, False), 4 if saved_hybrid else 3, timeout=60)
    assert_parameters(spawn(lambda b: run(b, not saved_hybrid, True), 3 if saved_hybrid else 4, timeout=60),
                      expected)


def test_a_tensor_parallel_hybrid_keeps_the_decay_split():
    """The LM at dp=2 x tp=2 over ZeRO-2, weight decay on matrices only: each rank's master chunk
    holds slices of split weights, cut into pieces by group as a ZeRO model's chunks are."""
    from tests.models.common import lm_loss, tiny_lm
    from tests.models.test_hybrid import batches
    spec = (torch.optim.AdamW, {"lr": 1e-2}, [(lambda n, p: p.dim() > 1, {"weight_decay": 0.5}),
                                               (lambda n, p: True, {"weight_decay": 0.0})])
    one = tiny_lm()
    opt = grouped(one, spec)
    for x, y in batches():
        lm_loss(one(x), y).backward()
        opt.step()
        opt.zero_grad()
    dims = ParallelDims(dp=2, tp=2)

    def run(backend):
        model = HybridShardedModel(tiny_lm(), backend, dims=dims, data_parallel="zero2")
        opt = ZeRO2Optimizer(model, grouped(model.dense_named_parameters(), spec))
        for batch in batches():
            model.train_step(rank_slice(batch, model.groups.dp_index, dims.dp), lm_loss, opt)
        return model.gather_full_parameters()
    expected = {n: p.detach() for n, p in one.named_parameters()}
    assert_parameters(spawn(run, dims.world_size, timeout=60), expected)
