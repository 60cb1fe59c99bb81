"""Casts, device moves and copies of a wrapped model (distframe/models/casts.py).

``model.float(); model.double()`` after wrapping (a lower-precision evaluation, then back) gave
ZeRO-1/2/3's and FSDP's parameters new storage, cut off from the flat buffers the strategy laid
out: training went on silently wrong (forward used values the optimizer no longer moved). It is
now a ConfigError at the call, with nothing converted, so training goes on exactly; DDP's and
the model-parallel strategies' casts stay as they were. ``copy.deepcopy`` and pickle of a wrapped
model failed with "cannot pickle '_thread.lock'" and the like; they are a ConfigError saying how
to copy the weights."""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe import ConfigError, spawn
from distframe.models import HybridShardedModel, PipelineParallelModel, TensorParallelModel
from distframe.mesh import ParallelDims
from tests.models.common import SEED_LOCK, STRATEGIES


class WithBuffer(nn.Module):
    """A float64 MLP with a float32 buffer, so ``.double()`` converts the buffer alone."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
        self.register_buffer("scale", torch.full((2,), 0.5, dtype=torch.float32))

    def forward(self, x):
        return self.net(x) * self.scale.to(x.dtype)


def build() -> nn.Module:
    with SEED_LOCK:
        torch.manual_seed(0)
        return WithBuffer()


_G = torch.Generator().manual_seed(1)
BATCHES = [(torch.randn(4, 4, dtype=torch.float64, generator=_G),
            torch.randn(4, 2, dtype=torch.float64, generator=_G)) for _ in range(3)]


def reference(round_trip: bool) -> dict[str, torch.Tensor]:
    """Single-process SGD over the global batches; ``round_trip``: ``.float(); .double()`` after
    the first step (what DDP follows); else the casts change nothing, as where they are refused."""
    net = build()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for i, (x, y) in enumerate(BATCHES):
        if i == 1 and round_trip:
            net.float()
            net.double()
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return net.state_dict()


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_cast_after_wrapping_is_refused_where_the_strategy_cannot_follow_it(strategy):
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build(), backend)
        opt = opt_cls(model, torch.optim.SGD, lr=0.1)
        refused = None
        for i, (x, y) in enumerate(BATCHES):
            if i == 1:
                model.double()  # no change to the parameters: the buffer alone converts
                model.to("cpu")
                try:
                    model.float()  # an evaluation in float32, say
                    model.double()
                except ConfigError as error:
                    refused = str(error)
            rows = slice(2 * backend.rank, 2 * backend.rank + 2)
            model.train_step((x[rows], y[rows]), F.mse_loss, opt)
        return refused, model.gather_full_parameters()

    results = spawn(run, 2, timeout=60)
    follows = strategy == "ddp"
    expected = reference(round_trip=follows)
    for refused, full in results:
        if follows:
            assert refused is None
        else:
            assert refused is not None and "before wrapping" in refused and "autocast" in refused
        assert full["scale"].dtype == torch.float64  # the buffer took the first .double()
        for name, value in expected.items():
            torch.testing.assert_close(full[name], value.to(full[name].dtype), rtol=0, atol=1e-10)


@pytest.mark.parametrize("strategy", sorted(set(STRATEGIES) - {"ddp"}))
def test_a_refused_cast_changes_no_parameter_gradient_or_buffer(strategy):
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build(), backend)
        opt_cls(model, torch.optim.SGD, lr=0.1)
        x, y = BATCHES[0]
        F.mse_loss(model(x), y).backward()
        model.synchronize_gradients()
        before = [(p, p.data, p.grad) for p in model.parameters()]
        buffer = model.wrapped_model.scale
        with pytest.raises(ConfigError, match="cannot follow this cast.*nothing was changed"):
            model.half()
        for p, data, grad in before:
            assert p.data.is_set_to(data) and p.grad is grad
        assert model.wrapped_model.scale is buffer
        return True
    assert spawn(run, 2, timeout=60) == [True, True]


def _model_parallel(kind: str, backend):
    with SEED_LOCK:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), nn.Tanh(),
                            nn.Linear(4, 2)).double()
    if kind == "pipeline":
        return PipelineParallelModel(net, backend, num_microbatches=2)
    if kind == "tensor":
        return TensorParallelModel(net, backend, plan={"0": "column", "2": "row"})
    return HybridShardedModel(net, backend, dims=ParallelDims(dp=2, tp=1, pp=1))


@pytest.mark.parametrize("copier", ["deepcopy", "copy", "pickle"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES) + ["pipeline", "tensor", "hybrid"])
def test_copying_a_wrapped_model_is_refused_with_the_way_to_copy_its_weights(strategy, copier):
    def run(backend):
        if strategy in STRATEGIES:
            model = STRATEGIES[strategy][0](build(), backend)
        else:
            model = _model_parallel(strategy, backend)
        copy_fn = {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": pickle.dumps}[copier]
        with pytest.raises(ConfigError, match="cannot be copied or pickled.*gather_full_parameters"):
            copy_fn(model)
        # The module itself still copies (the EMA idiom), where its parameters are whole
        # (ZeRO-3/FSDP refuse it: test_module_state_guard.py).
        if strategy in STRATEGIES and strategy not in ("zero3", "fsdp"):
            copy.deepcopy(model.wrapped_model)
        return {k: v.shape for k, v in model.gather_full_parameters().items()}
    shapes = spawn(run, 2, timeout=60)  # values still come back from the ranks
    assert shapes[0] == shapes[1]
