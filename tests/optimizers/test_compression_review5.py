"""GradientCompressionOptimizer, review 5 (in-memory engine, float64). Before:
- a user compressor's state created as it ran ("ema/<name>" on first use) was saved but not
  loaded: the load read only the keys a fresh compressor's state_dict() already had;
- a user "all_reduce" compressor with a payload of two parts sent only the first and handed
  decompress a 1-tuple (a ValueError, or a silently wrong sum);
- a DDPOptimizer built after a GradientCompressionOptimizer on the same DDPModel still compressed;
- each rank's own state_dict() loaded back doubled rank 0's residuals (its world read as 1) and put
  rank 1 back at step 0 (the step count was rank 0's alone);
- PowerSGD took an empty (4, 0) parameter for compressible and failed at its first step;
- a state_dict() key without '/' failed state_dict() with a bare ValueError;
- a plain nn.Module failed with AttributeError ('backend') instead of a ConfigError."""
import copy

import pytest
import torch
from torch import nn

from distframe import checkpoint, spawn
from distframe.errors import ConfigError
from distframe.models import DDPModel
from distframe.models.ddp import allreduce_hook
from distframe.optimizers import DDPOptimizer
from distframe.optimizers.compressed import GradientCompressionOptimizer
from distframe.optimizers.compression import (Compressor, FP16Compressor, Int8Compressor,
                                              PowerSGDCompressor, TopKCompressor)
from tests.models.common import SEED_LOCK

with SEED_LOCK:  # threads share torch's global generator: ranks copy this instead of seeding
    torch.manual_seed(5)
    MLP = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _batch(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    x = torch.randn(3, 6, generator=g, dtype=torch.float64)
    return x, x[:, :2].sin()


def _train(model, opt, first, last):
    for step in range(first, last):
        model.train_step(_batch(step, model.backend.rank), nn.functional.mse_loss, opt)


def _build(b, compressor):
    model = DDPModel(copy.deepcopy(MLP), b)
    return model, GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.05,
                                               compressor=compressor)


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- a user compressor's state, created as it runs ----------------------------------------------
class RowScaledSign(Compressor):
    """sign(g) times a running mean of |g| per row, kept per parameter ("ema/<name>", (rows, 1)),
    created on first use."""

    exchange = "all_gather"

    def __init__(self):
        self._ema = {}

    def compress(self, tensor, *, key=None):
        rows = tensor.reshape(tensor.shape[0] if tensor.dim() else 1, -1)
        mag = rows.abs().mean(dim=1, keepdim=True)  # (rows, 1)
        old = self._ema.get(key)
        self._ema[key] = mag if old is None else 0.5 * old + 0.5 * mag
        return (rows.sign().to(torch.int8), self._ema[key].clone()), (tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):  # the parts may come flat (all_gather's wire)
        sign, scale = payload
        shape, dtype = ctx
        return (sign.to(dtype).reshape(scale.numel(), -1) * scale.to(dtype).reshape(-1, 1)).reshape(shape)

    def state_dict(self):
        return {f"ema/{k}": v.clone() for k, v in self._ema.items()}

    def load_state_dict(self, state):
        self._ema = {k.removeprefix("ema/"): v.clone() for k, v in state.items() if k.startswith("ema/")}


def test_user_compressor_state_created_as_it_ran_is_restored_in_its_shape(tmp_path):
    """Bitwise: the resumed run equals the uninterrupted one, and the compressor holds every saved
    entry in its shape again (before: none, and the resumed run drifted by about 1e-2)."""
    def fn(b):
        model, opt = _build(b, RowScaledSign())
        _train(model, opt, 0, 3)
        saved = opt.compressor.state_dict()
        checkpoint.save(tmp_path / "ck", model, opt, step=3)
        _train(model, opt, 3, 6)
        straight = model.gather_full_parameters()
        model, opt = _build(b, RowScaledSign())
        checkpoint.load(tmp_path / "ck", model, opt)
        restored = opt.compressor.state_dict()
        _train(model, opt, 3, 6)
        return _equal(restored, saved), _equal(model.gather_full_parameters(), straight)
    assert spawn(fn, 2, timeout=60) == [(True, True), (True, True)]


# ---- a summable payload of two parts ---------------------------------------------------------------
class FixedPointSplit(Compressor):
    """t = hi * 2**-20 + lo with hi int64 and lo float64: both add up across ranks, on two wires,
    and the sum is t's to float64 rounding."""

    exchange = "all_reduce"

    def compress(self, tensor, *, key=None):
        hi = torch.round(tensor * 2.0 ** 20).to(torch.int64)
        return (hi, tensor - hi.to(tensor.dtype) * 2.0 ** -20), tensor.dtype

    def decompress(self, payload, ctx):
        hi, lo = payload
        return hi.to(ctx) * 2.0 ** -20 + lo.to(ctx)


def test_every_part_of_a_summable_payload_is_summed():
    """The averaged gradient is DDP's to 1e-14 (float64, gradients below 10), from one
    all_reduce(SUM) per wire dtype (int64 and float64); before, decompress got hi alone."""
    def fn(b, compressor):
        model = DDPModel(copy.deepcopy(MLP), b)
        if compressor is None:
            DDPOptimizer(model, torch.optim.SGD, lr=0.1)
        else:
            GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.1, compressor=compressor)
        b.stats.reset()
        nn.functional.mse_loss(*_forward(model, b.rank)).backward()
        model.synchronize_gradients()
        return ({n: p.grad.clone() for n, p in model.wrapped_model.named_parameters()},
                b.stats.snapshot()["calls"].get("all_reduce", 0))
    ddp = spawn(lambda b: fn(b, None), 2, timeout=60)
    split = spawn(lambda b: fn(b, FixedPointSplit()), 2, timeout=60)
    assert [calls for _, calls in ddp] == [1, 1] and [calls for _, calls in split] == [2, 2]
    for (want, _), (got, _) in zip(ddp, split):
        assert max(g.abs().max().item() for g in want.values()) < 10
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-14)


def _forward(model, rank):
    x, y = _batch(0, rank)
    return model(x), y


# ---- a later optimizer takes the model over -------------------------------------------------------
def test_a_later_optimizer_ends_the_compression_hook_and_a_user_hook_stays():
    """A DDPOptimizer built after a dropped GradientCompressionOptimizer averages as DDP does
    (bitwise, one all_reduce, no top-k all_gather); a hook the user registered stays."""
    def grads(b, phase):
        model = DDPModel(copy.deepcopy(MLP), b)
        seen = []

        def user_hook(backend, bucket):
            seen.append(bucket)
            return allreduce_hook(backend, bucket)
        if phase == "compressed first":
            GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.1, compressor=TopKCompressor(0.1))
        if phase == "user hook":
            model.register_comm_hook(user_hook)
        DDPOptimizer(model, torch.optim.SGD, lr=0.1)
        b.stats.reset()
        nn.functional.mse_loss(*_forward(model, b.rank)).backward()
        model.synchronize_gradients()
        return ({n: p.grad.clone() for n, p in model.wrapped_model.named_parameters()},
                b.stats.snapshot()["calls"], len(seen))
    plain = spawn(lambda b: grads(b, "plain"), 2, timeout=60)
    after = spawn(lambda b: grads(b, "compressed first"), 2, timeout=60)
    hooked = spawn(lambda b: grads(b, "user hook"), 2, timeout=60)
    for (want, calls, _), (got, got_calls, _), (_, _, hook_calls) in zip(plain, after, hooked):
        assert _equal(got, want) and got_calls == calls == {"all_reduce": 1}
        assert hook_calls == 1


# ---- each rank's own state_dict() ------------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda: TopKCompressor(0.2), lambda: Int8Compressor(chunk_size=16),
                                  lambda: PowerSGDCompressor(rank=1, start_iter=4)],
                         ids=["topk", "int8", "powersgd-before-start"])
def test_each_rank_loads_its_own_state_dict_back_bitwise(make):
    """3 steps, each rank's opt.state_dict() into a new optimizer on the same model, 3 more ==
    6 uninterrupted steps, bitwise, and every rank is at step 3 (before: rank 0's residuals
    doubled and rank 1 at step 0, PowerSGD's ranks then compressing at different steps). Plain
    SGD: DDP's momentum buffers are saved in slices by the ranks, so they need every rank's state."""
    def fn(b):
        model, opt = _build(b, make())
        _train(model, opt, 0, 6)
        straight = model.gather_full_parameters()
        model, opt = _build(b, make())
        _train(model, opt, 0, 3)
        state = opt.state_dict()
        opt = GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.05, compressor=make())
        opt.load_state_dict(state)
        iteration = opt.iteration
        _train(model, opt, 3, 6)
        return iteration, _equal(model.gather_full_parameters(), straight)
    assert spawn(fn, 2, timeout=60) == [(3, True), (3, True)]


def test_one_ranks_state_that_cannot_load_is_a_config_error():
    """PowerSGD's warm start is rank 0's alone: rank 1's own state is refused (before: its ranks
    started from different factors); so is rank 0's own state at 1 rank, which lacks rank 1's
    residuals (before: loaded as if the saved world were 1)."""
    def first(b):
        model, opt = _build(b, PowerSGDCompressor(rank=1, start_iter=1))
        _train(model, opt, 0, 3)
        state = opt.state_dict()
        opt = GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.05,
                                           compressor=PowerSGDCompressor(rank=1, start_iter=1))
        if b.rank == 1:
            with pytest.raises(ConfigError, match="no PowerSGD warm-start factors.*distframe checkpoint"):
                opt.load_state_dict(state)
        else:
            opt.load_state_dict(state)
        return state
    states = spawn(first, 2, timeout=60)

    def second(b):
        model, opt = _build(b, PowerSGDCompressor(rank=1, start_iter=1))
        with pytest.raises(ConfigError, match=r"residuals of rank\(s\) \[0\].*rank\(s\) \[1\]"):
            opt.load_state_dict(states[0])
    spawn(second, 1, timeout=60)


# ---- PowerSGD and an empty parameter -------------------------------------------------------------
class WithEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = copy.deepcopy(MLP[0])
        self.empty = nn.Parameter(torch.zeros(4, 0, dtype=torch.float64))  # a zero-width embedding

    def forward(self, x):
        return self.lin(x)[:, :2] + self.empty.sum()


def test_powersgd_passes_a_parameter_without_elements_through():
    assert not PowerSGDCompressor(rank=1).compressible((4, 0))
    assert not PowerSGDCompressor(rank=1).compressible((0, 4))

    def fn(b):
        model = DDPModel(WithEmpty(), b)
        opt = GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.05,
                                           compressor=PowerSGDCompressor(rank=1, start_iter=0))
        _train(model, opt, 0, 3)
        return model.gather_full_parameters()
    out = spawn(fn, 2, timeout=60)
    assert _equal(out[0], out[1]) and out[0]["empty"].shape == (4, 0)
    assert all(bool(p.isfinite().all()) for p in out[0].values())


# ---- the key format of a compressor's state ------------------------------------------------------
class Counting(Compressor):
    """fp16 on the wire, counting its calls under ``key_name``."""

    def __init__(self, key_name):
        self.key_name, self.counter = key_name, torch.zeros(1, dtype=torch.int64)

    def compress(self, tensor, *, key=None):
        self.counter += 1
        return (tensor.to(torch.float16),), tensor.dtype

    def decompress(self, payload, ctx):
        return payload[0].to(ctx)

    def state_dict(self):
        return {self.key_name: self.counter.clone()}

    def load_state_dict(self, state):
        self.counter = state[self.key_name].clone()


def test_state_keys_are_what_slash_name(tmp_path):
    """'counter' and 'residual/x' are ConfigErrors naming the format; 'counter/' (state of the
    whole compressor) goes through a checkpoint."""
    def fn(b):
        for bad in ("counter", "residual/0.weight"):
            model, opt = _build(b, Counting(bad))
            _train(model, opt, 0, 1)
            with pytest.raises(ConfigError, match="'<what>/<parameter name>'"):
                opt.state_dict()
        model, opt = _build(b, Counting("counter/"))
        _train(model, opt, 0, 2)
        checkpoint.save(tmp_path / "ck", model, opt, step=2)
        model, opt = _build(b, Counting("counter/"))
        checkpoint.load(tmp_path / "ck", model, opt)
        return int(opt.compressor.counter)
    assert spawn(fn, 2, timeout=60) == [12, 12]  # 6 parameter tensors a step, 2 steps


def test_a_plain_module_is_a_config_error():
    with pytest.raises(ConfigError, match="belongs with DDPModel.*DDPModel\\(module, backend\\)"):
        GradientCompressionOptimizer(nn.Linear(4, 2), torch.optim.SGD, lr=0.1, compressor=FP16Compressor())
