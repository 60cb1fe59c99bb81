"""A plain torch.optim optimizer built over a ZeRO/FSDP model's parameters (FSDP2's idiom, where
parameters are DTensors) never sees the reduced gradients: on ZeRO-2/3 and FSDP their ``.grad``
stay None and nothing trained, on ZeRO-1 each rank stepped its own un-averaged gradient and the
replicas drifted apart, all without a word. Its ``step()`` is now a ConfigError naming the
strategy's optimizer, raised before anything moves; DDP (whose parameters hold the averaged
gradients, as torch DDP's do) still takes a plain optimizer and trains as one process."""
import copy

import pytest
import torch
from torch import nn

from distframe import ConfigError, spawn
from distframe.mesh import ParallelDims
from distframe.models import HybridShardedModel, TensorParallelModel
from tests.models.common import SEED_LOCK, STRATEGIES, tiny_lm

with SEED_LOCK:
    torch.manual_seed(0)
    NET = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
X = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def plain_step(backend, strategy, groups=None):
    model_cls, _ = STRATEGIES[strategy]
    model = model_cls(copy.deepcopy(NET), backend)
    opt = torch.optim.SGD(model.parameters() if groups is None else groups(model), lr=0.1)
    rows = slice(2 * backend.rank, 2 * backend.rank + 2)
    model(X[rows]).pow(2).sum().backward()
    before = model.gather_full_parameters()
    try:
        opt.step()
    except ConfigError as exc:
        after = model.gather_full_parameters()
        assert all(torch.equal(after[k], before[k]) for k in before), "the refused step moved nothing"
        return str(exc)
    return model.gather_full_parameters()


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp"])
def test_a_plain_optimizer_over_a_sharded_model_is_refused_at_step(strategy):
    want = STRATEGIES[strategy][1].__name__
    for message in spawn(lambda b: plain_step(b, strategy), 2, timeout=20):
        assert isinstance(message, str) and want in message and "model.parameters()" in message


_OUTSIDE = nn.Parameter(torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("groups", [
    lambda model: [_OUTSIDE, *model.parameters()],  # the model's after a parameter of its own
    lambda model: [{"params": [_OUTSIDE]}, {"params": [_OUTSIDE.new_zeros(1).requires_grad_(),
                                                       *model.parameters()]}]])
def test_the_models_parameters_anywhere_in_a_group_are_refused(groups):
    # Only each group's first parameter was looked at: a loss temperature or a second model's
    # parameter ahead of the model's let the plain step through.
    for message in spawn(lambda b: plain_step(b, "zero2", groups), 2, timeout=20):
        assert isinstance(message, str) and "ZeRO2Optimizer" in message


def test_ddp_still_takes_a_plain_optimizer_and_equals_one_process():
    one = copy.deepcopy(NET)
    opt = torch.optim.SGD(one.parameters(), lr=0.1)
    (one(X).pow(2).sum() / 2).backward()  # DDP averages the two ranks' sums
    opt.step()
    for params in spawn(lambda b: plain_step(b, "ddp"), 2, timeout=20):
        for name, value in one.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-12)


def test_the_sharded_optimizers_and_unrelated_optimizers_are_untouched():
    def run(backend):
        model_cls, opt_cls = STRATEGIES["zero2"]
        model = model_cls(copy.deepcopy(NET), backend)
        opt = opt_cls(model, torch.optim.SGD, lr=0.1)
        other = nn.Linear(2, 2)
        torch.optim.SGD(other.parameters(), lr=0.1).step()  # no gradients: a no-op, not refused
        model(X).pow(2).sum().backward()
        opt.step()
        return True
    assert spawn(run, 2, timeout=20) == [True, True]


def test_a_plain_optimizer_over_a_hybrid_zero_model_is_refused():
    def run(backend):
        model = HybridShardedModel(tiny_lm(), backend, dims=ParallelDims(dp=2), data_parallel="zero2")
        with pytest.raises(ConfigError, match="ZeRO2Optimizer"):
            torch.optim.SGD(model.parameters(), lr=0.1).step()
        return True
    assert spawn(run, 2, timeout=20) == [True, True]


@pytest.mark.parametrize("whole", ["Adafactor", "Muon", "LBFGS"])
@pytest.mark.parametrize("layout", ["tensor", "hybrid"])
def test_a_whole_parameter_optimizer_over_tensor_parallel_slices_is_refused(layout, whole):
    """Adafactor factors a parameter's matrix, Muon orthogonalises it, LBFGS takes all parameters
    at once: over a tensor-parallel rank's slices each computes something other than one
    process's step, without a word. Refused at step(), before anything moves; an element-wise
    optimizer over the same parameters steps."""
    def run(backend):
        with SEED_LOCK:
            torch.manual_seed(0)
            dense = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()
        plan = {"0": "column", "2": "row"}
        model = (TensorParallelModel(dense, backend, plan=plan) if layout == "tensor" else
                 HybridShardedModel(dense, backend, dims=ParallelDims(tp=2), tp_plan=plan))
        model(X).pow(2).sum().backward()
        params = [p for p in model.parameters() if whole != "Muon" or p.dim() == 2]  # Muon: matrices
        opt = getattr(torch.optim, whole)(params)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ConfigError, match=rf"torch.optim.{whole} .*tensor-parallel"):
            opt.step(lambda: model(X).pow(2).sum()) if whole == "LBFGS" else opt.step()
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        torch.optim.Adam(model.parameters()).step()
        return True
    assert spawn(run, 2, timeout=20) == [True, True]
