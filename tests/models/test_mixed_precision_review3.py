"""Mixed precision, from a third review: a policy given to a model-parallel model (refused, not
ignored), floating forward inputs cast to ``param_dtype`` (FSDP2's ``cast_forward_inputs``), frozen
parameters of any floating dtype cast to it (in-place edits after wrapping: test_in_place_edits.py).

Exactness: where a run is compared with the same computation written by hand (inputs or frozen
weights cast by the user), the results are bitwise equal."""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe import HybridShardedModel, ParallelDims, PipelineParallelModel, TensorParallelModel, checkpoint
from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import MixedPrecisionPolicy
from tests.models.common import SEED_LOCK, SETTINGS, STRATEGIES

F32 = MixedPrecisionPolicy(param_dtype=torch.float32)
SHARDED = ["zero1", "zero2", "zero3", "fsdp"]
WORLD, LR = 2, 0.1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def net(seed: int = 0) -> Net:
    with SEED_LOCK:
        torch.manual_seed(seed)
        return Net().double()


def batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=g, dtype=torch.float64),
             torch.randn(6, 3, generator=g, dtype=torch.float64)) for _ in range(steps)]


def rows(batch, rank: int):
    x, y = batch
    per = x.shape[0] // WORLD
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def loss64(output, target):
    return F.mse_loss(output.double(), target)


def settings(strategy: str, **extra) -> dict:
    out = dict(SETTINGS[strategy])
    if strategy == "fsdp":
        out["auto_wrap_min_params"] = 10   # one unit per Linear of Net
    out.update(extra)
    return out


def wrap(strategy: str, module: nn.Module, backend, **extra):
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(module, backend, **settings(strategy, **extra))
    return model, opt_cls(model, torch.optim.SGD, lr=LR)


# ---- A. model-parallel models refuse a policy instead of ignoring it -------------------------------
def mlp() -> nn.Sequential:
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))


MODEL_PARALLEL = {
    "pipeline": lambda b, **kw: PipelineParallelModel(mlp(), b, num_microbatches=2, **kw),
    "tensor": lambda b, **kw: TensorParallelModel(mlp(), b, plan={"0": "column", "2": "row"}, **kw),
    "hybrid-ddp": lambda b, **kw: HybridShardedModel(mlp(), b, dims=ParallelDims(dp=2), **kw),
    "hybrid-zero1": lambda b, **kw: HybridShardedModel(mlp(), b, dims=ParallelDims(dp=2),
                                                       data_parallel="zero1", **kw),
    "hybrid-zero2": lambda b, **kw: HybridShardedModel(mlp(), b, dims=ParallelDims(dp=2),
                                                       data_parallel="zero2", **kw),
}


@pytest.mark.parametrize("kind", list(MODEL_PARALLEL))
def test_a_model_parallel_model_refuses_a_mixed_precision_policy(kind):
    # It was accepted and ignored: the parameters stayed float32 (the ZeRO shards too).
    def run(backend):
        with pytest.raises(ConfigError, match=r"mixed_precision.*torch\.autocast.*ZeRO"):
            MODEL_PARALLEL[kind](backend, mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        MODEL_PARALLEL[kind](backend)   # and without one it builds
        return True
    assert spawn(run, WORLD, timeout=60) == [True, True]


# ---- B. floating forward inputs are cast to param_dtype --------------------------------------------
@dataclasses.dataclass
class Extra:
    scale: torch.Tensor
    ids: torch.Tensor


Pair = collections.namedtuple("Pair", "low mask")


class Probe(nn.Module):
    """Records the dtypes of what its forward receives."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.seen: list = []

    def forward(self, x, nested, *, extra: Extra):
        self.seen.append((x.dtype, nested["pair"].low.dtype, nested["pair"].mask.dtype,
                          nested["list"][0].dtype, extra.scale.dtype, extra.ids.dtype))
        return self.lin(x) * extra.scale + nested["list"][0].sum()


def probe() -> Probe:
    with SEED_LOCK:
        torch.manual_seed(0)
        return Probe().double()


def probe_inputs(x):
    nested = {"pair": Pair(torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.bool)),
              "list": [torch.ones(2, dtype=torch.float64)]}
    return (x, nested), {"extra": Extra(torch.full((3,), 2.0, dtype=torch.float64), torch.arange(3))}


@pytest.mark.parametrize("strategy", SHARDED)
def test_floating_inputs_in_nested_containers_are_cast_to_param_dtype(strategy):
    def run(backend):
        model, _ = wrap(strategy, probe(), backend, mixed_precision=F32)
        x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
        args, kwargs = probe_inputs(x)
        out = model(*args, **kwargs)
        out.sum().backward()   # the cast is differentiable: the input's gradient is in its dtype
        return model.module.seen[-1], x.grad.dtype, out.dtype
    f32, f64 = torch.float32, torch.float64
    for seen, grad_dtype, out_dtype in spawn(run, WORLD, timeout=60):
        assert seen == (f32, f32, torch.bool, f32, f32, torch.int64)
        assert (grad_dtype, out_dtype) == (f64, f32)


@pytest.mark.parametrize("fields", [{"param_dtype": torch.float32, "cast_forward_inputs": False},
                                    {"reduce_dtype": torch.float32}],
                         ids=["cast_forward_inputs=False", "no param_dtype"])
def test_inputs_are_left_alone_without_a_cast(fields):
    def run(backend):
        model, _ = wrap("zero2", probe(), backend, mixed_precision=MixedPrecisionPolicy(**fields))
        args, kwargs = probe_inputs(torch.randn(2, 4, dtype=torch.float64))
        with torch.no_grad():
            try:
                model(*args, **kwargs)
            except RuntimeError:   # float64 inputs into float32 weights: torch refuses, as asked
                pass
        return model.module.seen[-1][0], model.module.seen[-1][3]
    assert spawn(run, WORLD, timeout=60) == [(torch.float64, torch.float64)] * WORLD


def test_cast_forward_inputs_must_be_a_bool():
    with pytest.raises(ConfigError, match="cast_forward_inputs"):
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs="yes")


@pytest.mark.parametrize("strategy", SHARDED)
def test_train_step_with_float64_inputs_equals_casting_them_by_hand(strategy):
    # It failed inside F.linear: "mat1 and mat2 must have the same dtype".
    def run(backend, by_hand):
        model, opt = wrap(strategy, net(), backend, mixed_precision=F32)
        for batch in batches():
            x, y = rows(batch, backend.rank)
            model.train_step((x.float() if by_hand else x, y), loss64, opt)
        return model.gather_full_parameters()
    for got, expected in zip(spawn(lambda b: run(b, False), WORLD, timeout=60),
                             spawn(lambda b: run(b, True), WORLD, timeout=60)):
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0)


# ---- C. frozen parameters of any floating dtype take param_dtype ---------------------------------
class FrozenHalf(nn.Module):
    """A frozen base stored in ``base_dtype`` under a float64 trainable head."""

    def __init__(self, base_dtype: torch.dtype) -> None:
        super().__init__()
        with SEED_LOCK:
            torch.manual_seed(0)
            self.base = nn.Linear(4, 6).half().to(base_dtype).requires_grad_(False)
            self.head = nn.Linear(6, 3).double()

    def forward(self, x):
        return self.head(torch.tanh(self.base(x)))


def train_frozen(strategy, base_dtype, backend, steps=2):
    model, opt = wrap(strategy, FrozenHalf(base_dtype), backend, mixed_precision=F32)
    dtypes = {n: p.dtype for n, p in model.module.named_parameters() if not p.requires_grad}
    for batch in batches(steps):
        x, y = rows(batch, backend.rank)
        model.train_step((x.float(), y), loss64, opt)
    return model, opt, dtypes


@pytest.mark.parametrize("strategy", SHARDED)
def test_a_frozen_half_precision_base_trains_as_one_cast_by_hand(strategy):
    # A float16 base under a float32 policy stayed float16: "mat1 and mat2 must have the same dtype".
    def run(backend, base_dtype):
        model, _, dtypes = train_frozen(strategy, base_dtype, backend)
        return model.gather_full_parameters(), dtypes
    for (got, dtypes), (expected, _) in zip(spawn(lambda b: run(b, torch.float16), WORLD, timeout=60),
                                            spawn(lambda b: run(b, torch.float32), WORLD, timeout=60)):
        assert set(dtypes.values()) == {torch.float32}
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_a_checkpoint_of_a_cast_frozen_base_loads(strategy, tmp_path):
    def run(backend):
        model, opt, _ = train_frozen(strategy, torch.float16, backend)
        checkpoint.save(tmp_path / "ck", model, opt)
        saved = model.gather_full_parameters()
        fresh, fresh_opt = wrap(strategy, FrozenHalf(torch.float16), backend, mixed_precision=F32)
        with torch.no_grad():
            fresh.module.base.weight.zero_()
        checkpoint.load(tmp_path / "ck", fresh, fresh_opt)
        return saved, fresh.gather_full_parameters()
    for saved, loaded in spawn(run, WORLD, timeout=60):
        for name, value in saved.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)
