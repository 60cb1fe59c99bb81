"""nn.SyncBatchNorm under the data-parallel strategies normalises by the global batch's statistics:
parity with one process's nn.BatchNorm1d/2d over the whole batch (float64, 1e-10): outputs,
gradients, running statistics and parameters after Adam steps. torch's SyncBatchNorm alone
synchronises only over torch.distributed's default group, which distframe never initialises, so
it used each rank's slice (1.25 off in a small model) without a word."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models import DDPModel, HybridShardedModel, ZeRO1Model
from distframe.optimizers import ZeRO2Optimizer
from tests.models.common import SEED_LOCK, STRATEGIES

TOL = 1e-10
STEPS, BATCH = 3, 12
SETTINGS = {
    "ddp": {"bucket_cap_mb": 0.0005, "first_bucket_cap_mb": 0.0002},
    "zero1": {"bucket_cap_mb": 0.0005, "first_bucket_cap_mb": 0.0002},
    "zero2": {"bucket_cap_mb": 0.0005, "first_bucket_cap_mb": 0.0002},
    "zero3": {},
    "fsdp": {"auto_wrap_min_params": 20},
}


def dense(kind: str) -> nn.Sequential:
    """The single-process model: plain BatchNorm (one with a cumulative average and no affine, one
    without running statistics). The layers before a norm have no bias, whose gradient is zero
    there: Adam would scale up its rounding noise."""
    with SEED_LOCK:
        torch.manual_seed(0)
        if kind == "1d":
            return nn.Sequential(nn.Linear(5, 6, bias=False), nn.BatchNorm1d(6), nn.Tanh(),
                                 nn.Linear(6, 4, bias=False), nn.BatchNorm1d(4, momentum=None, affine=False),
                                 nn.Linear(4, 2)).double()
        return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3), nn.Tanh(),
                             nn.Flatten(), nn.Linear(48, 4, bias=False),
                             nn.BatchNorm1d(4, track_running_stats=False), nn.Linear(4, 2)).double()


def synced(kind: str) -> nn.Module:
    return nn.SyncBatchNorm.convert_sync_batchnorm(dense(kind))


def batches(kind: str, size: int = BATCH, steps: int = STEPS):
    g = torch.Generator().manual_seed(7)
    shape = (size, 5) if kind == "1d" else (size, 2, 4, 4)
    return [(torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.5,
             torch.randn(size, 2, generator=g, dtype=torch.float64)) for _ in range(steps)]


def piece(batch, rank: int, world: int):
    per = batch[0].shape[0] // world
    return batch[0][rank * per:(rank + 1) * per], batch[1][rank * per:(rank + 1) * per]


def reference(kind: str):
    """One process, the global batch: first output and gradients, then the state after each step."""
    model = dense(kind)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first, states = None, []
    for x, y in batches(kind):
        x = x.clone().requires_grad_()
        out = model(x)
        F.mse_loss(out, y).backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), math.inf)
        if first is None:
            first = (out.detach(), x.grad, norm, {n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return first, states


def run_rank(backend, strategy: str, kind: str, *, hybrid: str | None = None):
    world, rank = backend.world_size, backend.rank
    if hybrid is None:
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(synced(kind), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
    else:
        model = HybridShardedModel(synced(kind), backend, dims=ParallelDims(dp=world), data_parallel=hybrid)
        opt = (torch.optim.Adam(model.parameters(), lr=1e-2) if hybrid == "ddp"
               else ZeRO2Optimizer(model, torch.optim.Adam, lr=1e-2))
    first, states = None, []
    for batch in batches(kind):
        x, y = piece(batch, rank, world)
        x = x.clone().requires_grad_()
        out = model(x)
        F.mse_loss(out, y).backward()
        norm = model.clip_grad_norm_(math.inf)  # synchronises; the global gradient's norm
        if first is None:
            named = model.module.named_parameters() if strategy == "ddp" else []
            grads = {n: p.grad.clone() for n, p in named}
            first = (out.detach(), x.grad, norm, grads)
        opt.step()
        opt.zero_grad()
        states.append(model.gather_full_parameters())
    return first, states


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    diff = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    assert diff <= TOL, f"{what}: {diff:.3g}"


def check_against_reference(results, kind: str, world: int, strategy: str) -> None:
    (out, x_grad, norm, grads), states = reference(kind)
    per = BATCH // world
    for rank, (first, got_states) in enumerate(results):
        rows = slice(rank * per, (rank + 1) * per)
        assert_close(first[0], out[rows], f"rank {rank} output")
        # Every rank's loss depends on every rank's rows through the statistics, so a rank's input
        # gradient is that of the sum of the ranks' (slice-mean) losses: world x the global mean's.
        assert_close(first[1], world * x_grad[rows], f"rank {rank} input gradient")
        assert_close(first[2].double(), norm.double(), f"rank {rank} gradient norm")
        for name, grad in first[3].items():
            assert_close(grad, grads[name], f"rank {rank} gradient of {name}")
        assert strategy != "ddp" or set(first[3]) == set(grads)
        for step, (got, want) in enumerate(zip(got_states, states)):
            assert set(got) == set(want)
            for key in want:
                assert_close(got[key], want[key], f"rank {rank} step {step} {key}")


@pytest.mark.parametrize("kind", ["1d", "2d"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_sync_batch_norm_matches_one_process_over_the_global_batch(strategy, world, kind):
    results = spawn(lambda b: run_rank(b, strategy, kind), world, timeout=60)
    check_against_reference(results, kind, world, strategy)


@pytest.mark.parametrize("data_parallel", ["ddp", "zero2"])
def test_hybrid_data_parallel_synchronises_over_its_replicas(data_parallel):
    results = spawn(lambda b: run_rank(b, "hybrid", "1d", hybrid=data_parallel), 2, timeout=60)
    check_against_reference(results, "1d", 2, "hybrid")


def _gloo_rank(backend):
    return run_rank(backend, "ddp", "2d")


@pytest.mark.gloo
def test_gloo_processes_synchronise_too():
    check_against_reference(spawn(_gloo_rank, 2, backend="gloo", timeout=120), "2d", 2, "ddp")


def test_world_of_one_is_plain_batch_norm():
    results = spawn(lambda b: run_rank(b, "ddp", "1d"), 1)
    check_against_reference(results, "1d", 1, "ddp")


@pytest.mark.parametrize("sizes", [(5, 1, 3), (6, 0, 3)])
def test_uneven_slices_give_the_global_statistics(sizes):
    """Slices of different sizes (one empty): outputs and running statistics of the global batch,
    and with a sum loss (whose sum over ranks is the global one) its exact gradients."""
    x = batches("1d", size=sum(sizes), steps=1)[0][0]
    starts = [sum(sizes[:r]) for r in range(len(sizes))]

    def run(b):
        model = DDPModel(synced("1d"), b)
        mine = x[starts[b.rank]:starts[b.rank] + sizes[b.rank]].clone().requires_grad_()
        out = model(mine)
        out.square().sum().backward()
        model.synchronize_gradients()
        grads = {n: p.grad.clone() for n, p in model.module.named_parameters()}
        return out.detach(), mine.grad, grads, model.gather_full_parameters()

    results = spawn(run, len(sizes), timeout=60)
    plain, whole = dense("1d"), x.clone().requires_grad_()
    out = plain(whole)
    out.square().sum().backward()
    for rank, (got, x_grad, grads, state) in enumerate(results):
        rows = slice(starts[rank], starts[rank] + sizes[rank])
        assert_close(got, out.detach()[rows], "output")
        assert_close(x_grad, whole.grad[rows], "input gradient")
        for name, p in plain.named_parameters():  # DDP averages: the global sum's over world
            assert_close(grads[name] * len(sizes), p.grad, f"gradient of {name}")
        for key, value in plain.state_dict().items():
            assert_close(state[key], value, key)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_eval_mode_communicates_nothing(strategy):
    model_cls, opt_cls = STRATEGIES[strategy]
    probe = batches("1d", size=4, steps=1)[0][0]

    def run(b):
        model = model_cls(synced("1d"), b)
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        for batch in batches("1d"):
            model.train_step(piece(batch, b.rank, b.world_size), F.mse_loss, opt)
        calls = sum(b.stats.calls.values())
        with torch.no_grad():  # training mode: the statistics are gathered, two norms, two calls
            model(probe)
        training_calls = sum(b.stats.calls.values()) - calls
        model.eval()
        calls = sum(b.stats.calls.values())
        with torch.no_grad():
            evaluated = model(probe)
        with_grad = model(probe).detach()
        eval_calls = sum(b.stats.calls.values()) - calls
        return training_calls, eval_calls, evaluated, with_grad, model.gather_full_parameters()

    results = spawn(run, 2, timeout=60)
    plain = dense("1d")
    plain.load_state_dict(results[0][4])
    plain.eval()
    with torch.no_grad():
        want = plain(probe)
    for training_calls, eval_calls, evaluated, with_grad, _ in results:
        assert training_calls == 2 and eval_calls == 0
        assert_close(evaluated, want, "eval output")
        assert_close(with_grad, want, "eval output with grad")


def test_one_value_per_channel_over_the_group_is_refused_on_every_rank():
    def run(b):
        model = DDPModel(synced("1d"), b)
        with pytest.raises(ValueError, match="more than 1 value per channel.*got 1 over the 2"):
            model(torch.randn(b.rank, 5, dtype=torch.float64))  # rank 0 has no rows, rank 1 one
        return model(torch.randn(2, 5, dtype=torch.float64)).shape  # the ranks still agree

    assert spawn(run, 2) == [torch.Size([2, 2])] * 2


def test_a_torch_process_group_is_refused():
    def run(b):
        net = synced("1d")
        net[1].process_group = object()  # what nn.SyncBatchNorm(..., process_group=group) stores
        with pytest.raises(ConfigError, match=r"'1'.*process_group.*process_group=None"):
            ZeRO1Model(net, b)
        net[1].process_group = None  # fixed, the same module wraps
        return DDPModel(net, b) is not None

    assert spawn(run, 2) == [True, True]


def test_a_subclass_with_its_own_forward_is_refused():
    class Scaled(nn.SyncBatchNorm):
        def forward(self, x):
            return 2 * super().forward(x)

    def run(b):
        net = nn.Sequential(nn.Linear(3, 4), Scaled(4)).double()
        with pytest.raises(ConfigError, match=r"'1' \(Scaled\).*forward of its own"):
            DDPModel(net, b)

    spawn(run, 2)


def test_a_deep_copy_of_the_wrapped_module_communicates_nothing():
    x = batches("1d", size=8, steps=1)[0][0]

    def run(b):
        model = DDPModel(synced("1d"), b)
        copied = copy.deepcopy(model.module)
        calls = sum(b.stats.calls.values())
        out = copied(x[4 * b.rank:4 * (b.rank + 1)])
        return out.detach(), sum(b.stats.calls.values()) - calls

    for rank, (out, calls) in enumerate(spawn(run, 2)):
        assert calls == 0  # a copy is not the wrapper's: torch's SyncBatchNorm outside a group
        assert_close(out, dense("1d")(x[4 * rank:4 * (rank + 1)]).detach(), "copy's output")
