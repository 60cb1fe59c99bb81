"""Accumulation, float32 and mixed precision, unused parameters, early stop and replica checks."""
import pytest
import torch
from torch import nn

from distframe.launch import spawn
from distframe.models import DDPModel, MixedPrecisionPolicy
from tests.models.common import (HIDDEN, IN, OUT, SETTINGS, STRATEGIES, build_model, global_batches,
                                 loss_fn, rank_slice, reference_run)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_no_sync_accumulation_equals_one_step_on_the_k_times_batch(strategy):
    k, world, micro = 3, 2, 4
    big = global_batches(1, k * micro * world)[0]

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        # Micro-batch j of rank r holds rows so that the union over ranks and micro-steps is `big`.
        for j in range(k):
            x, y = rank_slice(big, j * world + backend.rank, k * world)
            context = model.no_sync() if j < k - 1 else torch.enable_grad()
            with context:
                (loss_fn(model(x), y) / k).backward()
        opt.step()
        opt.zero_grad()
        return model.gather_full_parameters()
    expected = reference_run([big])[0]
    for params in spawn(run, world):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10)


@pytest.mark.parametrize("strategy, policy", [(s, None) for s in STRATEGIES] + [
    ("zero1", MixedPrecisionPolicy(reduce_dtype=torch.float32))])
def test_accumulation_over_synchronised_backwards_equals_one_step_on_the_k_times_batch(strategy, policy):
    # Several backwards before one step, each synchronising (no no_sync): as with torch DDP, the
    # averaged gradients add up. ZeRO-1 used to reduce the previous backward's gradients again.
    k, world, micro = 3, 2, 4
    big = global_batches(1, k * micro * world)[0]

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        extra = {} if policy is None else {"mixed_precision": policy}
        model = model_cls(build_model(), backend, **SETTINGS[strategy], **extra)
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        for j in range(k):
            x, y = rank_slice(big, j * world + backend.rank, k * world)
            (loss_fn(model(x), y) / k).backward()
        opt.step()
        opt.zero_grad()
        return model.gather_full_parameters()
    expected = reference_run([big])[0]
    # A float32 reduction of float64 gradients rounds them to ~1e-7 of their size.
    atol = 1e-10 if policy is None else 1e-6
    for params in spawn(run, world):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=atol)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_float32_parity(strategy):
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(torch.float32), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        for batch in global_batches(5, 12, torch.float32):
            model.train_step(rank_slice(batch, backend.rank, 3), loss_fn, opt)
        return model.gather_full_parameters()
    expected = reference_run(global_batches(5, 12, torch.float32), torch.float32)[-1]
    for params in spawn(run, 3):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp"])
def test_mixed_precision_keeps_float32_masters_and_tracks_full_precision(strategy):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(torch.float32), backend, mixed_precision=policy, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.SGD, lr=1.0)
        x, y = global_batches(1, 12, torch.float32)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.train_step(rank_slice((x.bfloat16(), y), backend.rank, 2),
                             lambda out, t: loss_fn(out.float(), t), opt)
        assert all(s.dtype == torch.float32 for s in model.local_parameter_shard())
        return model.gather_full_parameters()
    initial = build_model(torch.float32).state_dict()
    reference = build_model(torch.float32)
    x, y = global_batches(1, 12, torch.float32)[0]
    loss_fn(reference(x), y).backward()
    for params in spawn(run, 2):
        for name, p in reference.named_parameters():
            assert params[name].dtype == torch.float32
            # SGD with lr 1 moves each parameter by its gradient: bf16 compute gets it to ~1%.
            torch.testing.assert_close(initial[name] - params[name], p.grad, rtol=0.05, atol=2e-3)


@pytest.mark.parametrize("strategy", ["zero1", "zero3", "fsdp"])
def test_master_weights_never_fall_below_the_models_dtype_unless_asked(strategy):
    # The masters were float32 whenever param_dtype was set: a float64 model with a no-op policy
    # (param_dtype=float64) trained in float32 masters, 1e-8 away from one process.
    def run(backend, policy, dtype=torch.float64):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(dtype), backend, mixed_precision=policy, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        masters = {s.dtype for s in model.local_parameter_shard()}
        if dtype == torch.float64 and policy.param_dtype == torch.float64:
            for batch in global_batches(5, 12):
                model.train_step(rank_slice(batch, backend.rank, 2), loss_fn, opt)
        return masters, model.gather_full_parameters()

    expected = reference_run(global_batches(5, 12))[-1]
    for masters, params in spawn(lambda b: run(b, MixedPrecisionPolicy(param_dtype=torch.float64)), 2):
        assert masters == {torch.float64}
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10)
    lowered = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert spawn(lambda b: run(b, lowered)[0], 2) == [{torch.float64}] * 2
    assert spawn(lambda b: run(b, lowered, torch.float16)[0], 2) == [{torch.float32}] * 2
    asked = MixedPrecisionPolicy(param_dtype=torch.bfloat16, master_dtype=torch.bfloat16)
    assert spawn(lambda b: run(b, asked, torch.float32)[0], 2) == [{torch.bfloat16}] * 2


class TwoHeads(nn.Module):
    """Head `b` is used only when asked: parameters that get no gradient in some steps."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.a = nn.Linear(8, 3)
        self.b = nn.Linear(8, 3)

    def forward(self, x, use_b=False):
        h = torch.relu(self.trunk(x))
        return self.b(h) if use_b else self.a(h)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_parameters_without_gradients_never_hang(strategy):
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        torch.manual_seed(0)
        model = model_cls(TwoHeads().double(), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.SGD, lr=0.1)
        x, y = global_batches(1, 4)[0]
        for step in range(3):
            out = model(x, use_b=(step == 1))
            loss_fn(out, y).backward()
            opt.step()
            opt.zero_grad()
        return model.gather_full_parameters()
    results = spawn(run, 2, timeout=20)
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name], rtol=0, atol=0)


def test_should_early_stop_reaches_consensus():
    def run(backend):
        model = DDPModel(build_model(), backend)
        opt = STRATEGIES["ddp"][1](model, torch.optim.SGD, lr=0.1)
        return opt.should_early_stop(backend.rank == 2), opt.should_early_stop(False)
    assert spawn(run, 4) == [(True, False)] * 4


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_module_is_the_wrapped_model(strategy):
    # torch DDP and DeepSpeed users reach the model as `.module` (generation, saving the
    # unwrapped state dict); it is the wrapped model, not a copy.
    def run(backend):
        inner = build_model()
        model = STRATEGIES[strategy][0](inner, backend, **SETTINGS[strategy])
        return model.module is inner and model.module is model.wrapped_model
    assert spawn(run, 2) == [True, True]


def test_construction_broadcasts_rank_0_weights():
    def run(backend):
        model = DDPModel(build_model(seed=backend.rank), backend)
        return model.gather_full_parameters()
    results = spawn(run, 3)
    for name, value in build_model(seed=0).state_dict().items():
        for params in results:
            torch.testing.assert_close(params[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("max_norm", [None, 0.05])
def test_ddp_gradients_are_averaged_when_backward_returns(max_norm):
    # The torch DDP loop with a plain optimizer: backward, (clip,) step. Nothing calls
    # synchronize_gradients, so backward itself must leave the averaged gradients (it used to
    # leave each rank's own, and the replicas drifted apart).
    def step(model, opt, x, y):
        loss_fn(model(x), y).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()

    def run(backend):
        model = DDPModel(build_model(), backend, **SETTINGS["ddp"])
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for batch in global_batches(4, 12):
            step(model, opt, *rank_slice(batch, backend.rank, backend.world_size))
        return model.gather_full_parameters()
    reference = build_model()
    opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for batch in global_batches(4, 12):
        step(reference, opt, *batch)
    for params in spawn(run, 3):
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10)


class Checkpointed(nn.Module):
    """build_model() with every layer after the first (whose input needs no gradient, which
    reentrant checkpointing requires) recomputed in backward, the last layer included."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.m, self.reentrant = build_model(), reentrant

    def forward(self, x):
        x = self.m[0](x)
        for layer in self.m[1:]:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_of_the_last_layer(strategy, reentrant):
    # Reentrant checkpointing runs a backward of its own inside the user's, and with the last
    # layer checkpointed that nested backward reaches parameters first: the reductions must
    # still finish when the user's backward does, not the nested one (that raised 'a gradient
    # arrived ... after it was reduced').
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(Checkpointed(reentrant), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        for batch in global_batches(4, 12):
            model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
        return model.gather_full_parameters()
    expected = reference_run(global_batches(4, 12))[-1]
    for params in spawn(run, 2, timeout=20):
        for name, value in expected.items():
            torch.testing.assert_close(params[f"m.{name}"], value, rtol=0, atol=1e-10)


def batch_norm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, OUT)).double()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_follow_rank_0_as_torch_ddp(strategy, broadcast):
    # Each rank's BatchNorm sees its own slice, so its running statistics drift from its peers'.
    # As with torch DDP (broadcast_buffers=True) rank 0's are copied to every rank before each
    # synchronising forward, and before gather_full_parameters, which DESIGN.md promises is the
    # same on every rank; broadcast_buffers=False keeps each rank's own.
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(batch_norm_model(), backend, broadcast_buffers=broadcast, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.SGD, lr=0.1)
        own_means, full = [], []
        for batch in global_batches(3, 12):
            model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
            own_means.append(model.wrapped_model[1].running_mean.clone())
            full.append(model.gather_full_parameters())
        return own_means, full
    results = spawn(run, 3, timeout=20)
    for step in range(3):
        rank0_mean = results[0][0][step]
        for rank, (own_means, full) in enumerate(results):
            got = full[step]["1.running_mean"]
            if broadcast:
                torch.testing.assert_close(got, rank0_mean, rtol=0, atol=0)
                torch.testing.assert_close(full[step]["1.num_batches_tracked"],
                                           torch.tensor(step + 1), rtol=0, atol=0)
            else:
                torch.testing.assert_close(got, own_means[step], rtol=0, atol=0)
                assert rank == 0 or not torch.equal(got, rank0_mean)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_forward_under_no_grad_between_forward_and_backward_changes_nothing(strategy):
    # Evaluating (under torch.no_grad) after the training forward and before its backward: the
    # backward still synchronises. ZeRO-3 and FSDP took the no-grad forward as the one the next
    # backward belonged to and reduced nothing (the step ran on no gradient at all).
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        for batch in global_batches(3, 12):
            x, y = rank_slice(batch, backend.rank, backend.world_size)
            output = model(x)
            with torch.no_grad():
                model(x)
            loss_fn(output, y).backward()
            opt.step()
            opt.zero_grad()
        return model.gather_full_parameters()
    expected = reference_run(global_batches(3, 12))[-1]
    for params in spawn(run, 2, timeout=20):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_local_shards_hold_averaged_gradients_when_backward_returns(strategy):
    # docs/design.md: a synchronising backward finishes its reductions as its last act, so what
    # reads gradients before optimizer.step() (GradScaler.unscale_, a norm logged by hand) sees
    # them all. ZeRO-3 and FSDP left the last units' reduce_scatters to synchronize_gradients().
    batch = global_batches(1, 12)[0]
    reference = build_model()
    loss_fn(reference(batch[0]), batch[1]).backward()
    full = {name: p.grad.reshape(-1) for name, p in reference.named_parameters()}

    def run(backend):
        model_cls, _ = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        x, y = rank_slice(batch, backend.rank, backend.world_size)
        loss_fn(model(x), y).backward()
        layout = model.shard_layout()
        return [(None if shard.grad is None else shard.grad.clone(), segments)
                for shard, segments in zip(layout.shards, layout.segments)]
    for shards in spawn(run, 3, timeout=20):
        for grad, segments in shards:
            for seg in segments:
                assert grad is not None, f"{seg.name}: no gradient after backward"
                torch.testing.assert_close(
                    grad.reshape(-1)[seg.shard_offset:seg.shard_offset + seg.length],
                    full[seg.name][seg.param_offset:seg.param_offset + seg.length], rtol=0, atol=1e-12)
