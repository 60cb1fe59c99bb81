"""Loss scaling (GradScaler) with sharded optimizers: every rank that steps together must take the
same skip decision and keep the same scale, equal to one process's plain GradScaler."""
import copy

import pytest
import torch
from torch import nn

from distframe import (AsyncSGDOptimizer, ConfigError, DDPModel, ElasticOptimizer,
                       PipelineParallelModel, ShardedGradScaler)
from distframe.launch import spawn
from tests.models.common import SEED_LOCK, STRATEGIES

IN, HIDDEN, OUT = 4, 8, 2
WORLD, ROWS = 2, 8            # 4 rows per rank
OVERFLOW_STEP, OVERFLOW_ROW = 1, 6  # a row of rank 1's slice
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
# Momentum SGD, not Adam: Adam's update barely changes when gradients stay scaled.
OPTIMIZER = {"lr": 0.05, "momentum": 0.9}


class _GradTimes(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient of row i by ``factor[i]``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.save_for_backward(factor)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (factor,) = ctx.saved_tensors
        return grad * factor, None


class SpikeNet(nn.Module):
    """An MLP plus one scalar ``spike`` whose gradient a row makes inf (its last input column is
    that row's factor, 1 otherwise): one element, so exactly one rank's shard holds it."""

    def __init__(self):
        super().__init__()
        self.spike = nn.Parameter(torch.zeros(1))
        self.body = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))

    def forward(self, inputs):
        x, factor = inputs[:, :IN], inputs[:, IN:]
        return self.body(x) + _GradTimes.apply(self.spike * x[:, :1], factor)


def build(dtype):
    with SEED_LOCK:
        torch.manual_seed(0)
        return SpikeNet().to(dtype)


def batches(dtype, steps=4):
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(steps):
        x = torch.randn(ROWS, IN, generator=g, dtype=torch.float64)
        factor = torch.ones(ROWS, 1, dtype=torch.float64)
        if step == OVERFLOW_STEP:
            factor[OVERFLOW_ROW] = float("inf")
        out.append((torch.cat([x, factor], 1).to(dtype), torch.randn(ROWS, OUT, generator=g).to(dtype)))
    return out


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)


def make_scaler(scaler_cls, **kwargs):
    # Growth every 2 clean steps, so the run both backs off (the overflow) and grows.
    return scaler_cls("cpu", init_scale=2.0 ** 8, growth_interval=2, **kwargs)


def reference(dtype, unscale_first):
    """One process, plain GradScaler, whole batches: (scale, parameters) after every step."""
    model = build(dtype)
    opt = torch.optim.SGD(model.parameters(), **OPTIMIZER)
    scaler = make_scaler(torch.amp.GradScaler)
    history = []
    for x, y in batches(dtype):
        scaler.scale(loss_fn(model(x), y)).backward()
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        history.append((scaler.get_scale(), copy.deepcopy(model.state_dict())))
    return history


def local_overflow(opt):
    """Whether this rank's shard (what its GradScaler inspects) holds a non-finite gradient."""
    return any(p.grad is not None and not torch.isfinite(p.grad).all()
               for group in opt.param_groups for p in group["params"])


def sharded_run(strategy, dtype, unscale_first, scaler_cls, make_optimizer=None):
    """Each rank's (scale, full parameters) after every step, and at OVERFLOW_STEP which ranks'
    shards overflowed (all_gather of the flags), from ``make_optimizer(model)`` (default: the
    strategy's optimizer)."""
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build(dtype), backend)
        opt = (make_optimizer or (lambda m: opt_cls(m, torch.optim.SGD, **OPTIMIZER)))(model)
        scaler = make_scaler(scaler_cls)
        history, overflows = [], None
        for step, batch in enumerate(batches(dtype)):
            rows = slice(backend.rank * ROWS // WORLD, (backend.rank + 1) * ROWS // WORLD)
            x, y = batch[0][rows], batch[1][rows]
            scaler.scale(loss_fn(model(x), y)).backward()
            if step == OVERFLOW_STEP:
                model.synchronize_gradients()
                flag = torch.tensor([float(local_overflow(opt))])
                overflows = backend.all_gather(flag).tolist()
            if unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            history.append((scaler.get_scale(), model.gather_full_parameters()))
        return history, overflows, getattr(opt, "step_count", None)
    return spawn(run, WORLD, timeout=20)


def assert_same_history(history, expected, dtype):
    for step, ((scale, params), (want_scale, want)) in enumerate(zip(history, expected, strict=True)):
        assert scale == want_scale, f"step {step}: scale {scale}, one process {want_scale}"
        for name, value in want.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=TOLERANCE[dtype],
                                       msg=lambda m, step=step, name=name: f"step {step} {name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp"])
def test_sharded_scaler_equals_one_process_with_an_overflow_in_one_shard(strategy, dtype):
    expected = reference(dtype, unscale_first=False)
    # The overflow step is skipped and halves the scale; the next two steps double it again.
    assert [scale for scale, _ in expected] == [256.0, 128.0, 128.0, 256.0]
    for history, overflows, _ in sharded_run(strategy, dtype, False, ShardedGradScaler):
        assert sorted(overflows) == [0.0, 1.0]  # the premise: one rank's shard overflows
        assert_same_history(history, expected, dtype)


@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_sharded_scaler_with_unscale_before_step_equals_one_process(strategy):
    expected = reference(torch.float64, unscale_first=True)
    for history, _, _ in sharded_run(strategy, torch.float64, True, ShardedGradScaler):
        assert_same_history(history, expected, torch.float64)


@pytest.mark.parametrize("unscale_first", [False, True])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp"])
def test_plain_grad_scaler_on_a_sharded_optimizer_raises_config_error(strategy, unscale_first):
    # Raised at the first step, overflow or not, before any rank skips: never a silent divergence.
    with pytest.raises(ConfigError, match="ShardedGradScaler"):
        sharded_run(strategy, torch.float64, unscale_first, torch.amp.GradScaler)


def test_a_refused_scaler_step_leaves_nothing_for_the_next_step():
    # Before: GradScaler set grad_scale and found_inf on the optimizer and deletes them only after
    # a step that returned, so a step after the caught ConfigError took them for its own (and
    # raised again, or unscaled by the old scale).
    def run(backend):
        model_cls, opt_cls = STRATEGIES["zero2"]
        model = model_cls(build(torch.float64), backend)
        opt = opt_cls(model, torch.optim.SGD, **OPTIMIZER)
        x, y = batches(torch.float64)[0]
        scaler = make_scaler(torch.amp.GradScaler)
        scaler.scale(loss_fn(model(x), y)).backward()
        with pytest.raises(ConfigError, match="ShardedGradScaler"):
            scaler.step(opt)
        left = [name for name in ("grad_scale", "found_inf") if hasattr(opt, name)]
        before = [p.detach().clone() for p in model.local_parameter_shard()]
        opt.step()  # the gradients are still scaled by 256: an SGD step on them moves the shard
        moved = any(not torch.equal(a, p) for a, p in zip(before, model.local_parameter_shard()))
        return left, moved
    assert spawn(run, WORLD, timeout=20) == [([], True)] * WORLD


@pytest.mark.parametrize("scaler_cls", [torch.amp.GradScaler, ShardedGradScaler])
def test_ddp_with_either_scaler_equals_one_process(scaler_cls):
    # DDP's ranks hold the same averaged gradients, so a plain GradScaler agrees by itself.
    expected = reference(torch.float64, unscale_first=False)
    for history, overflows, _ in sharded_run("ddp", torch.float64, False, scaler_cls):
        assert overflows == [1.0, 1.0]
        assert_same_history(history, expected, torch.float64)


def test_elastic_optimizer_over_zero2_skips_on_every_rank_and_commits_only_taken_steps():
    expected = reference(torch.float64, unscale_first=False)

    def elastic(model):
        return ElasticOptimizer(model, torch.optim.SGD, **OPTIMIZER)
    for history, overflows, step_count in sharded_run("zero2", torch.float64, False, ShardedGradScaler,
                                                      elastic):
        assert sorted(overflows) == [0.0, 1.0]
        assert_same_history(history, expected, torch.float64)
        assert step_count == len(expected) - 1  # the skipped step is no step


def test_plain_grad_scaler_on_elastic_over_zero2_raises_config_error():
    def elastic(model):
        return ElasticOptimizer(model, torch.optim.SGD, **OPTIMIZER)
    with pytest.raises(ConfigError, match="ShardedGradScaler"):
        sharded_run("zero2", torch.float64, False, torch.amp.GradScaler, elastic)


class SpikeStage(nn.Module):
    """SpikeNet's first layer alone, for a pipeline stage: a row's factor scales its gradient."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, HIDDEN)

    def forward(self, inputs):
        return _GradTimes.apply(self.fc(inputs[:, :IN]), inputs[:, IN:])


def pipeline_net():
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(SpikeStage(), nn.Tanh(), nn.Linear(HIDDEN, OUT)).double()


def pipeline_reference():
    """One process, plain GradScaler, pipeline_net on whole batches: (scale, state) per step."""
    model = pipeline_net()
    opt = torch.optim.SGD(model.parameters(), **OPTIMIZER)
    scaler = make_scaler(torch.amp.GradScaler)
    expected = []
    for x, y in batches(torch.float64):
        scaler.scale(loss_fn(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        expected.append((scaler.get_scale(), copy.deepcopy(model.state_dict())))
    return expected


def model_parallel_history(backend, model, opt, scaler, rows):
    """(scale, full parameters) after each step of ``model`` on ``rows`` of every batch, and which
    ranks' parameters held a non-finite gradient at OVERFLOW_STEP."""
    history, overflows = [], None
    for step, batch in enumerate(batches(torch.float64)):
        model.forward_backward((batch[0][rows], batch[1][rows]),
                               lambda out, target: scaler.scale(loss_fn(out, target)))
        if step == OVERFLOW_STEP:
            model.synchronize_gradients()
            overflows = backend.all_gather(torch.tensor([float(local_overflow(opt))])).tolist()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        history.append((scaler.get_scale(), model.gather_full_parameters()))
    return history, overflows


def test_pipeline_with_a_plain_optimizer_and_sharded_scaler_equals_one_process():
    # Stage 0's gradients overflow, stage 1's do not: both stages skip together.
    expected = pipeline_reference()

    def run(backend):
        model = PipelineParallelModel(pipeline_net(), backend, num_microbatches=1, split_points=[1])
        opt = torch.optim.SGD(model.parameters(), **OPTIMIZER)
        scaler = make_scaler(ShardedGradScaler, backend=model.backend)
        return model_parallel_history(backend, model, opt, scaler, slice(None))
    for history, overflows in spawn(run, WORLD, timeout=20):
        assert overflows == [1.0, 0.0]
        assert_same_history(history, expected, torch.float64)


def test_sharded_scaler_needs_a_backend_for_a_plain_optimizer_and_refuses_async_sgd():
    def run(backend):
        model = DDPModel(build(torch.float64), backend)
        scaler = ShardedGradScaler("cpu")
        scaler.scale(torch.ones(()))  # creates the scale
        with pytest.raises(ConfigError, match="backend=model.backend"):
            scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))
        other = ShardedGradScaler("cpu", backend=backend.new_group([0, 1]))
        other.scale(torch.ones(()))
        with pytest.raises(ConfigError, match="leave backend=None"):
            other.unscale_(STRATEGIES["ddp"][1](model, torch.optim.SGD, lr=0.1))
        async_sgd = AsyncSGDOptimizer(model, torch.optim.SGD, lr=0.1)
        with pytest.raises(ConfigError, match="plain torch.amp.GradScaler"):
            scaler.unscale_(async_sgd)
    spawn(run, WORLD, timeout=20)


def test_hybrid_zero2_pipeline_with_sharded_scaler_equals_one_process():
    # dp=2 x pp=2 over ZeRO-2: stage 0's gradients overflow and stage 1's do not, so the flag must
    # be agreed across the pipeline and the data-parallel group alike (model.backend: the world).
    from distframe import HybridShardedModel, ParallelDims, ZeRO2Optimizer
    expected = pipeline_reference()
    dims = ParallelDims(dp=2, pp=2)

    def run(backend):
        model = HybridShardedModel(pipeline_net(), backend, dims=dims, data_parallel="zero2",
                                   split_points=[1])
        opt = ZeRO2Optimizer(model, torch.optim.SGD, **OPTIMIZER)
        scaler = make_scaler(ShardedGradScaler)
        dp_index = dims.coordinates(backend.rank)["dp"]
        rows = slice(dp_index * ROWS // 2, (dp_index + 1) * ROWS // 2)
        return model_parallel_history(backend, model, opt, scaler, rows)
    for history, overflows in spawn(run, 4, timeout=20):
        assert overflows == [1.0, 1.0, 0.0, 0.0]  # ranks 0, 1: stage 0 (its ZeRO-2 shards); 2, 3: stage 1
        assert_same_history(history, expected, torch.float64)


@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_a_closure_passed_positionally_to_the_sharded_scaler_step_raises_config_error(strategy):
    # torch's GradScaler refuses step(opt, closure=...) but passes a positional closure on; the
    # optimizer then ran it after unscaling, adding the closure's scaled gradients to the
    # unscaled ones on every rank alike: a silently wrong step. Refused on every rank instead.
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build(torch.float64), backend)
        opt = opt_cls(model, torch.optim.SGD, **OPTIMIZER)
        scaler = make_scaler(ShardedGradScaler)
        x, y = batches(torch.float64, steps=1)[0]

        def closure():
            loss = scaler.scale(loss_fn(model(x), y))
            loss.backward()
            return loss
        closure()
        with pytest.raises(ConfigError, match="closure"):
            scaler.step(opt, closure)
        return True
    assert spawn(run, WORLD, timeout=20) == [True] * WORLD
