"""ElasticOptimizer restarted from a checkpoint (in-memory engine, float64): the owned LR
scheduler and the step count come back, so the resumed run equals the uninterrupted one bitwise."""
import copy

import torch
from torch import nn

from distframe import checkpoint, spawn
from distframe.models import DDPModel, ZeRO2Model
from distframe.optimizers.elastic import ElasticOptimizer

torch.manual_seed(5)
MLP = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 2)).double()
LR = 0.01


def _batch(step):
    g = torch.Generator().manual_seed(900 + step)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    return x, x[:, :2].sin()


def _decay(step):
    return 1.0 / (1 + step)


def _elastic(model, **kw):
    return ElasticOptimizer(model, torch.optim.Adam, lr=LR, lr_scheduler=lambda o: (
        torch.optim.lr_scheduler.LambdaLR(o, _decay)), **kw)


def _train_to(model, opt, total):
    while opt.step_count < total:
        model.train_step(opt.local_slice(_batch(opt.step_count)), nn.functional.mse_loss, opt)


def _bitwise_equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_restart_from_a_checkpoint_resumes_the_owned_scheduler(tmp_path):
    """6 steps checkpointed (every 2nd commit) then a fresh world restarts from step-6: before,
    the scheduler started again at epoch 0 (lr 0.01 at step 6 instead of 0.01/7) and the commit
    made at the restart held no scheduler state for survivors of a later failure."""
    def straight(b):
        model = ZeRO2Model(copy.deepcopy(MLP), b)
        opt = _elastic(model)
        _train_to(model, opt, 9)
        return model.gather_full_parameters(), opt.param_groups[0]["lr"]

    def first(b):
        model = ZeRO2Model(copy.deepcopy(MLP), b)
        opt = _elastic(model, checkpoint_dir=tmp_path, checkpoint_every=2)
        _train_to(model, opt, 7)  # step 7 is not checkpointed: the restart repeats it

    def resumed(b):
        model = ZeRO2Model(copy.deepcopy(MLP), b)
        opt = _elastic(model, checkpoint_dir=tmp_path)
        at_restart = (opt.step_count, opt.lr_scheduler.last_epoch, opt.param_groups[0]["lr"],
                      opt.member.commit.lr_scheduler["last_epoch"])
        _train_to(model, opt, 9)
        return model.gather_full_parameters(), opt.param_groups[0]["lr"], at_restart

    expected = spawn(straight, 2, timeout=30)
    spawn(first, 2, timeout=30)
    for (params, lr), (got, got_lr, at_restart) in zip(expected, spawn(resumed, 2, timeout=30)):
        assert at_restart == (6, 6, LR * _decay(6), 6)
        assert got_lr == lr == LR * _decay(9)
        assert _bitwise_equal(got, params)


def test_checkpoint_save_and_load_carry_step_count_and_scheduler_state(tmp_path):
    """checkpoint.save/load called by the user (no ``step=``) round-trip what the optimizer
    needs to go on: its step count and its scheduler's epoch and rates."""
    def fn(b):
        model = DDPModel(copy.deepcopy(MLP), b)
        opt = _elastic(model)
        _train_to(model, opt, 3)
        checkpoint.save(tmp_path / "ck", model, opt)
        _train_to(model, opt, 5)
        straight = model.gather_full_parameters()
        checkpoint.load(tmp_path / "ck", model, opt)
        loaded = opt.step_count, opt.lr_scheduler.last_epoch, opt.param_groups[0]["lr"]
        _train_to(model, opt, 5)
        return loaded, straight, model.gather_full_parameters()
    for loaded, straight, again in spawn(fn, 2, timeout=30):
        assert loaded == (3, 3, LR * _decay(3))
        assert _bitwise_equal(straight, again)
