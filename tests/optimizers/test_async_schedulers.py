"""AsyncSGDOptimizer's learning-rate schedule (in-memory engine, float64): the server's
``lr_scheduler`` sets the rate (and OneCycleLR's momentum) of every update it applies, scaled by
staleness with ``staleness_lr``, and a checkpoint resumes it. Before, the server applied every
update at the rate it held when serve() began, and a scheduler a worker stepped moved only that
worker's unused rate: both silently ignored. A rate changed on a worker is now refused at its
next push, and a scheduler built on the server's AsyncSGDOptimizer at serve()."""
import copy

import pytest
import torch
from torch import nn

from distframe import checkpoint, spawn
from distframe.errors import ConfigError
from distframe.models import DDPModel
from distframe.optimizers.async_sgd import AsyncSGDOptimizer
from tests.models.common import SEED_LOCK

LR = 0.05
STEPS = 4  # per worker
WORKERS = (1, 2)

with SEED_LOCK:
    torch.manual_seed(7)
    MLP = nn.Sequential(nn.Linear(5, 10), nn.Tanh(), nn.Linear(10, 2)).double()

L = torch.optim.lr_scheduler


def _halving(update):
    return 0.5 ** update


def _onecycle(opt):
    return L.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS * len(WORKERS))


def _batch(worker, k):
    g = torch.Generator().manual_seed(1000 * worker + k)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64)
    return x, torch.stack([x.sum(1), x[:, 0] * x[:, 1]], dim=1)


def _build(b, lr_scheduler=None, **settings):
    model = DDPModel(copy.deepcopy(MLP), b)
    opt = AsyncSGDOptimizer(model, torch.optim.SGD, lr=LR, deterministic=True,
                            lr_scheduler=lr_scheduler, **settings)
    return model, opt


def _session(b, opt, first=0, last=STEPS):
    """Serves, or trains worker ``b.rank`` on its batches ``first..last-1``; returns the server's
    last rate and momentum (None on workers)."""
    if not opt.is_server:
        for k in range(first, last):
            opt.train_step(_batch(b.rank, k), nn.functional.mse_loss)
        opt.finish()
        return None
    opt.serve()
    return opt.param_groups[0]["lr"], opt.param_groups[0].get("momentum")


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_the_servers_one_cycle_schedule_equals_the_sequential_run():
    """max_staleness=0: one process stepping SGD (momentum) and OneCycleLR over the workers'
    batches in turn; OneCycleLR moves the momentum as well as the rate."""
    def fn(b):
        model, opt = _build(b, _onecycle, momentum=0.9, max_staleness=0)
        last = _session(b, opt)
        return opt.is_server, model.wrapped_model.state_dict(), last

    model = copy.deepcopy(MLP)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = _onecycle(opt)
    for k in range(STEPS):
        for w in WORKERS:
            x, y = _batch(w, k)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
    (is_server, params, (lr, momentum)), *_ = spawn(fn, 3, timeout=60)
    assert is_server
    assert _max_diff(params, model.state_dict()) <= 1e-10
    assert lr == pytest.approx(opt.param_groups[0]["lr"], abs=1e-15)
    assert momentum == pytest.approx(opt.param_groups[0]["momentum"], abs=1e-15)


def test_staleness_scales_the_scheduled_rate():
    """Round robin, each worker a gradient behind: update u (0-based) applies at
    LR * 0.5**u / (1 + staleness), the scheduler's rate scaled, not the rate serve() began with."""
    def fn(b):
        model, opt = _build(b, lambda o: L.LambdaLR(o, _halving), max_staleness=2, staleness_lr=True)
        _session(b, opt)
        return model.wrapped_model.state_dict()

    current = {k: v.clone() for k, v in MLP.state_dict().items()}
    pulled = {w: (current, 0) for w in WORKERS}
    version = 0
    for k in range(STEPS):
        for w in WORKERS:
            at, at_version = pulled[w]
            reference = copy.deepcopy(MLP)
            reference.load_state_dict(at)
            x, y = _batch(w, k)
            nn.functional.mse_loss(reference(x), y).backward()
            lr = LR * _halving(version) / (1 + version - at_version)
            current = {name: v - lr * p.grad for (name, v), p in
                       zip(current.items(), reference.parameters())}
            version += 1
            pulled[w] = (current, version)
    server_params = spawn(fn, 3, timeout=60)[0]
    assert _max_diff(server_params, current) <= 1e-12


@pytest.mark.parametrize("server_rank", [0, 2])
def test_a_checkpoint_resumes_the_servers_schedule(tmp_path, server_rank):
    """Saved after 2 updates per worker (after synchronize_optimizer_state) and loaded into a
    new optimizer with the same lr_scheduler: the resumed run equals the uninterrupted one."""
    def scheduled(b):
        return _build(b, _onecycle, momentum=0.9, max_staleness=0, server_rank=server_rank)

    def fn(b):
        model, opt = scheduled(b)
        _session(b, opt)
        opt.synchronize_parameters()
        straight = model.gather_full_parameters()
        model, opt = scheduled(b)
        _session(b, opt, 0, 2)
        opt.synchronize_parameters()
        opt.synchronize_optimizer_state()
        checkpoint.save(tmp_path / "ck", model, opt, step=4)
        model, opt = scheduled(b)
        checkpoint.load(tmp_path / "ck", model, opt)
        at_load = opt.lr_scheduler.last_epoch
        _session(b, opt, 2, STEPS)
        opt.synchronize_parameters()
        return straight, model.gather_full_parameters(), at_load

    for straight, resumed, at_load in spawn(fn, 3, timeout=60):
        assert at_load == 4
        assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_a_worker_saving_a_schedule_it_did_not_synchronise_is_refused(tmp_path):
    def fn(b):
        model, opt = _build(b, _onecycle, max_staleness=0, server_rank=2)
        _session(b, opt)
        opt.synchronize_parameters()
        checkpoint.save(tmp_path / "ck", model, opt)

    with pytest.raises(ConfigError, match="synchronize_optimizer_state"):
        spawn(fn, 3, timeout=60)


def _worker_changes(change):
    """Rank 0 serves; each worker trains 3 steps, calling what ``change(opt)`` returned after
    each, as a synchronous loop steps its scheduler."""
    def fn(b):
        model, opt = _build(b, max_staleness=0)
        if opt.is_server:
            return opt.serve()
        after_step = change(opt)
        for k in range(3):
            opt.train_step(_batch(b.rank, k), nn.functional.mse_loss)
            after_step()
        opt.finish()
        return None
    return fn


def _a_scheduler_built_here(opt):
    return L.LambdaLR(opt, _halving).step


def _the_rate_set_by_hand(opt):
    def lower():
        for group in opt.param_groups:
            group["lr"] = LR / 10
    return lower


@pytest.mark.parametrize("change", [_a_scheduler_built_here, _the_rate_set_by_hand],
                         ids=["scheduler", "by_hand"])
def test_a_workers_rate_change_is_refused_at_its_next_push(change):
    with pytest.raises(ConfigError, match=r"would be ignored; schedule the server's rate instead: "
                                          r"AsyncSGDOptimizer\(model, \.\.\., lr_scheduler="):
        spawn(_worker_changes(change), 3, timeout=60)


def test_a_scheduler_built_on_the_servers_optimizer_is_refused_at_serve():
    def fn(b):
        model, opt = _build(b, max_staleness=0)
        L.LambdaLR(opt, _halving)
        _session(b, opt)

    with pytest.raises(ConfigError, match="serve\\(\\) never steps it"):
        spawn(fn, 3, timeout=60)


def test_a_scheduler_whose_step_needs_a_metric_is_refused_when_built():
    def fn(b):
        _build(b, lambda o: L.ReduceLROnPlateau(o))

    with pytest.raises(ConfigError, match="needs 'metrics'.*use a step-based scheduler"):
        spawn(fn, 2, timeout=30)
