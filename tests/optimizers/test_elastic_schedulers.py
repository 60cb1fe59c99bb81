"""ElasticOptimizer's owned lr scheduler (in-memory engine, float64) through a membership change,
a rollback and a restart from a checkpoint: OneCycleLR and CyclicLR set the momentum (SGD) or
betas (Adam) as well as the lr, and a restore used to give back only the lr, so the run went on
with the momentum of the schedule's first step (0.95 where the uninterrupted run had 0.8688).
A scheduler whose step needs a metric (ReduceLROnPlateau) failed every worker at the first step;
it is refused when the optimizer is built."""
import copy

import pytest
import torch
from torch import nn

from distframe import spawn
from distframe.errors import ConfigError
from distframe.models import DDPModel, ZeRO2Model
from distframe.optimizers.elastic import ElasticOptimizer
from distframe.optimizers.elastic_membership import ElasticController
from tests.models.common import SEED_LOCK

TOTAL = 8
LR = 0.05

with SEED_LOCK:
    torch.manual_seed(11)
    MLP = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2)).double()

L = torch.optim.lr_scheduler
SCHEDULERS = {
    "onecycle": lambda opt: L.OneCycleLR(opt, max_lr=0.1, total_steps=TOTAL),
    "cyclic": lambda opt: L.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=2),
}
OPTIMIZERS = {"sgd_momentum": (torch.optim.SGD, {"lr": LR, "momentum": 0.9}),
              "adam": (torch.optim.Adam, {"lr": LR})}
# CyclicLR cycles the momentum of an optimizer that has one (Adam has betas: it refuses those).
CASES = [("onecycle", "sgd_momentum"), ("onecycle", "adam"), ("cyclic", "sgd_momentum")]


def _global_batch(step):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(12, 6, generator=g, dtype=torch.float64)
    return x, torch.stack([x[:, 0].sin(), x[:, 1] * x[:, 2]], dim=1)


def _momentum(group):
    return group["betas"][0] if "betas" in group else group["momentum"]


def _reference(scheduler, optimizer):
    """One process, the same global batches, the scheduler stepped after every step."""
    cls, settings = OPTIMIZERS[optimizer]
    model = copy.deepcopy(MLP)
    opt = cls(model.parameters(), **settings)
    sched = SCHEDULERS[scheduler](opt)
    for step in range(TOTAL):
        x, y = _global_batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    return model.state_dict(), _momentum(opt.param_groups[0])


def _train_to(model, opt, total):
    while opt.step_count < total and not opt.membership_changes:
        model.train_step(opt.local_slice(_global_batch(opt.step_count)), nn.functional.mse_loss, opt)


def _elastic_worker(scheduler, optimizer, fail_at=None):
    cls, settings = OPTIMIZERS[optimizer]

    def worker(backend, member):
        model = DDPModel(copy.deepcopy(MLP), backend)
        opt = ElasticOptimizer(model, cls, member=member, commit_every=2,
                               lr_scheduler=SCHEDULERS[scheduler], **settings)
        if member.worker_id == 2 and fail_at is not None:
            _train_to(model, opt, fail_at)
            if opt.step_count == fail_at:
                raise RuntimeError(f"worker 2 died after step {fail_at}")
        _train_to(model, opt, TOTAL)
        return opt.step_count, model.gather_full_parameters(), _momentum(opt.param_groups[0])
    return worker


def _assert_parity(results, reference):
    params, momentum = reference
    for step, got, got_momentum in results:
        assert step == TOTAL
        assert max(float((got[k] - v).abs().max()) for k, v in params.items()) <= 1e-10
        assert got_momentum == pytest.approx(momentum, abs=1e-12)


@pytest.mark.parametrize(("scheduler", "optimizer"), CASES, ids=[f"{s}-{o}" for s, o in CASES])
def test_a_membership_change_keeps_the_momentum_the_scheduler_set(scheduler, optimizer):
    """3 workers, 2 from step 3: the new group restores the commit made at the change."""
    controller = ElasticController(_elastic_worker(scheduler, optimizer), initial_world=3,
                                   schedule={3: 2}, timeout=60)
    generations = controller.run()
    assert [(len(g.members), g.start_step) for g in generations] == [(3, 0), (2, 3)]
    _assert_parity(generations[-1].results, _reference(scheduler, optimizer))


def test_a_rollback_to_the_initial_commit_keeps_the_fresh_schedules_momentum():
    """A worker dies after step 1, before any step's commit: the survivors restore the commit
    made at the start, which predates the scheduler; it now holds the momentum building the
    scheduler set (0.95), not the optimizer's own (0.9)."""
    controller = ElasticController(_elastic_worker("onecycle", "sgd_momentum", fail_at=1),
                                   initial_world=3, timeout=60)
    generations = controller.run()
    assert [(len(g.members), g.start_step, g.end) for g in generations][0] == (3, 0, "failed")
    assert generations[1].start_step == 0
    _assert_parity(generations[-1].results, _reference("onecycle", "sgd_momentum"))


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam"])
def test_a_restart_from_a_checkpoint_keeps_the_momentum_the_scheduler_set(tmp_path, optimizer):
    """3 ranks checkpoint step 4 (and train on to 5); 2 ranks restart from step-4 and finish."""
    cls, settings = OPTIMIZERS[optimizer]

    def run(total):
        def fn(backend):
            model = ZeRO2Model(copy.deepcopy(MLP), backend)
            opt = ElasticOptimizer(model, cls, commit_every=2, checkpoint_dir=tmp_path,
                                   checkpoint_every=2, lr_scheduler=SCHEDULERS["onecycle"], **settings)
            _train_to(model, opt, total)
            return opt.step_count, model.gather_full_parameters(), _momentum(opt.param_groups[0])
        return fn

    spawn(run(5), 3, timeout=60)
    _assert_parity(spawn(run(TOTAL), 2, timeout=60), _reference("onecycle", optimizer))


class _NeedsLoss:
    """A user's scheduler whose step takes the loss: refused by its signature, not its class."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, loss):
        for group in self.optimizer.param_groups:
            group["lr"] *= 0.5 if loss > 1 else 1.0

    def state_dict(self):
        return {}


@pytest.mark.parametrize("builder", [lambda opt: L.ReduceLROnPlateau(opt),
                                     _NeedsLoss],
                         ids=["ReduceLROnPlateau", "step_needs_loss"])
def test_a_scheduler_whose_step_needs_a_metric_is_refused_when_built(builder):
    def worker(backend, member):
        model = DDPModel(copy.deepcopy(MLP), backend)
        ElasticOptimizer(model, torch.optim.SGD, lr=LR, member=member, lr_scheduler=builder)
        raise AssertionError("the optimizer was built")

    with pytest.raises(ConfigError, match=r"step\(\) needs '(metrics|loss)'.*step it yourself after "
                                          r"validation, or use a step-based scheduler"):
        ElasticController(worker, initial_world=2, timeout=30).run()
