"""ElasticOptimizer with loss scaling (in-memory engine, float64): the GradScaler passed as
``grad_scaler=`` is part of every commit, so a joiner receives the scale, survivors rolled back
get back the scale of the commit, and a restart from a checkpoint resumes it: every replica uses
the uninterrupted run's scale at every step and ends with its parameters. A scaler that drives
the steps without being registered is refused at the membership change, not left to diverge."""
import copy

import pytest
import torch
from torch import nn

from distframe import ShardedGradScaler, spawn
from distframe.errors import ConfigError
from distframe.models import DDPModel, ZeRO2Model
from distframe.optimizers.elastic import ElasticOptimizer
from distframe.optimizers.elastic_membership import ElasticController

torch.manual_seed(11)
MLP = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2)).double()
GLOBAL_BATCH = 12  # divisible by 2 and 3
LR = 0.01
# The scale doubles after every step, so it has grown by the time a worker joins or rolls back.
SCALER = {"init_scale": 2.0 ** 4, "growth_interval": 1}
SETUPS = [(DDPModel, torch.amp.GradScaler), (DDPModel, ShardedGradScaler), (ZeRO2Model, ShardedGradScaler)]


def _ids(setup):
    return f"{setup[0].__name__}-{setup[1].__name__}"


def _batch(step, overflow=False):
    """The global batch of ``step``; ``overflow``: its first row is inf (the step is skipped)."""
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=torch.float64)
    y = torch.stack([x[:, 0].sin(), x[:, 1] * x[:, 2]], dim=1)
    if overflow:
        x[0] = float("inf")
    return x, y


def _reference(total, overflow_at=None):
    """One process, plain GradScaler (the first try of step ``overflow_at`` overflows): the
    (steps taken, scale) pairs it passes through, and the parameters after ``total`` steps."""
    model = copy.deepcopy(MLP)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    pairs, steps, overflowed = {(0, scaler.get_scale())}, 0, False
    while steps < total:
        overflow = steps == overflow_at and not overflowed
        overflowed |= overflow
        x, y = _batch(steps, overflow)
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        steps += not overflow
        pairs.add((steps, scaler.get_scale()))
    return pairs, model.state_dict()


class _WorkerDied(RuntimeError):
    pass


def _worker(setup, total, seen, *, register=True, fail_worker=None, fail_at=None, overflow_at=None,
            **elastic):
    """Trains with loss scaling; records (worker, steps taken, scale) at the restore and after
    each step. A worker keeps its scaler across generations (as a process would); a joiner
    builds a fresh one. The first try of step ``overflow_at`` overflows (on every worker)."""
    strategy, scaler_cls = setup
    scalers, overflowed = {}, set()

    def worker(backend, member):
        scaler = scalers.setdefault(member.worker_id, scaler_cls("cpu", **SCALER))
        model = strategy(copy.deepcopy(MLP), backend)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, member=member,
                               grad_scaler=scaler if register else None, **elastic)
        seen.append((member.worker_id, opt.step_count, scaler.get_scale()))
        while opt.step_count < total and not opt.membership_changes:
            if member.worker_id == fail_worker and opt.step_count == fail_at:
                raise _WorkerDied(f"worker {fail_worker} died after step {fail_at}")
            overflow = opt.step_count == overflow_at and member.worker_id not in overflowed
            x, y = opt.local_slice(_batch(opt.step_count, overflow))
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if overflow:
                overflowed.add(member.worker_id)
            seen.append((member.worker_id, opt.step_count, scaler.get_scale()))
        return opt.step_count, model.gather_full_parameters()
    return worker


def _check_run(generations, seen, total, overflow_at=None):
    pairs, reference = _reference(total, overflow_at)
    wrong = [(worker, steps, scale) for worker, steps, scale in seen if (steps, scale) not in pairs]
    assert not wrong, f"(worker, steps, scale) the uninterrupted run never had {sorted(pairs)}: {wrong}"
    for steps, params in generations[-1].results:
        assert steps == total
        assert max((params[k] - v).abs().max().item() for k, v in reference.items()) <= 1e-10


@pytest.mark.parametrize("overflow_at", [None, 2])
@pytest.mark.parametrize("setup", SETUPS, ids=_ids)
def test_a_joiner_receives_the_scale_and_the_replicas_equal_the_uninterrupted_run(setup, overflow_at):
    """2 -> 3 at step 3 (2: after a skipped step that halved the scale). Before: the joiner
    started from init_scale (16, the others 128), so gradients scaled by different factors were
    averaged and the replicas drifted apart."""
    seen = []
    worker = _worker(setup, 6, seen, overflow_at=overflow_at)
    generations = ElasticController(worker, initial_world=2, schedule={3: 3}, timeout=30).run()
    assert [(len(g.members), g.start_step, g.end) for g in generations] == [
        (2, 0, "clean"), (3, 3, "finished")]
    joined = 16.0 * 2 ** 3 / (1 if overflow_at is None else 2)  # the scale of step 3's commit
    assert (2, 3, joined) in seen  # the joiner's scale right after the restore
    _check_run(generations, seen, 6, overflow_at)


@pytest.mark.parametrize("setup", SETUPS, ids=_ids)
def test_survivors_rolled_back_to_a_commit_get_its_scale_back(setup):
    """Worker 2 joins at step 3 and dies after step 5; the last commit (every 2 steps) is step
    4. Before: the survivors went on from step 4 with the scale they had grown by step 5."""
    seen = []
    worker = _worker(setup, 7, seen, fail_worker=2, fail_at=5, commit_every=2)
    generations = ElasticController(worker, initial_world=2, schedule={3: 3}, timeout=30).run()
    assert [(len(g.members), g.start_step, g.end) for g in generations] == [
        (2, 0, "clean"), (3, 3, "failed"), (2, 4, "finished")]
    _check_run(generations, seen, 7)


def test_a_restart_from_a_checkpoint_resumes_the_scale(tmp_path):
    """A checkpoint is saved inside scaler.step (before scaler.update): it must hold the scale
    the next step uses. A fresh world of 3 with fresh scalers restarts from step-4."""
    def train(world, total, seen):
        def fn(b):
            scaler = torch.amp.GradScaler("cpu", **SCALER)
            model = DDPModel(copy.deepcopy(MLP), b)
            opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, grad_scaler=scaler,
                                   checkpoint_dir=tmp_path, checkpoint_every=2)
            seen.append((b.rank, opt.step_count, scaler.get_scale()))
            while opt.step_count < total:
                x, y = opt.local_slice(_batch(opt.step_count))
                scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            return opt.step_count, model.gather_full_parameters()
        return spawn(fn, world, timeout=30)
    train(2, 5, [])
    seen = []
    results = train(3, 6, seen)
    pairs, reference = _reference(6)
    assert seen and all(steps == 4 and (4, scale) in pairs for _, steps, scale in seen), seen
    for steps, params in results:
        assert steps == 6
        assert max((params[k] - v).abs().max().item() for k, v in reference.items()) <= 1e-10


def test_a_commit_between_scaler_step_and_update_holds_the_scale_update_sets():
    """Taken before scaler.update(), a commit must hold the scale the next step uses: grown after
    a step taken, backed off after one skipped (an explicit commit; the step's own commits and
    checkpoints are taken there too)."""
    def fn(b):
        scaler = torch.amp.GradScaler("cpu", **SCALER)
        model = DDPModel(copy.deepcopy(MLP), b)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, grad_scaler=scaler, commit_every=100)
        held = []
        for overflow in (False, True):
            x, y = opt.local_slice(_batch(0, overflow))
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            committed = opt.commit().grad_scaler
            scaler.update()
            opt.zero_grad()
            held.append((committed, scaler.state_dict()))
        return held
    for held in spawn(fn, 2, timeout=30):
        assert [committed for committed, _ in held] == [after for _, after in held]
        assert [committed["scale"] for committed, _ in held] == [32.0, 16.0]


@pytest.mark.parametrize("setup", [SETUPS[0], SETUPS[2]], ids=_ids)
def test_a_scaler_that_is_not_registered_is_refused_at_the_membership_change(setup):
    worker = _worker(setup, 6, [], register=False)
    controller = ElasticController(worker, initial_world=2, schedule={3: 3}, timeout=30)
    with pytest.raises(ConfigError, match=r"not registered.*grad_scaler=scaler"):
        controller.run()
    assert len(controller.generations) == 2  # the first group trained; the second refused


def test_a_scaler_registered_on_some_workers_only_is_refused():
    def fn(b):
        scaler = torch.amp.GradScaler("cpu", **SCALER)
        ElasticOptimizer(DDPModel(copy.deepcopy(MLP), b), torch.optim.Adam, lr=LR,
                         grad_scaler=scaler if b.rank == 0 else None)
    with pytest.raises(ConfigError, match=r"every worker.*grad_scaler="):
        spawn(fn, 2, timeout=30)


def test_a_scaler_other_than_the_registered_one_is_refused():
    def fn(b):
        model = DDPModel(copy.deepcopy(MLP), b)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, grad_scaler=torch.amp.GradScaler("cpu"))
        other = torch.amp.GradScaler("cpu")
        x, y = opt.local_slice(_batch(0))
        other.scale(nn.functional.mse_loss(model(x), y)).backward()
        with pytest.raises(ConfigError, match="other than the one passed as grad_scaler="):
            other.step(opt)
    spawn(fn, 2, timeout=30)


@pytest.mark.parametrize("strategy, scaler, needle", [
    (DDPModel, object(), "grad_scaler=<object"),
    (ZeRO2Model, torch.amp.GradScaler("cpu"), "ShardedGradScaler"),
])
def test_a_bad_grad_scaler_is_a_config_error(strategy, scaler, needle):
    def fn(b):
        with pytest.raises(ConfigError, match=needle):
            ElasticOptimizer(strategy(copy.deepcopy(MLP), b), torch.optim.Adam, lr=LR, grad_scaler=scaler)
    spawn(fn, 1)
