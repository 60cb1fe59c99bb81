"""ElasticOptimizer and ElasticController (in-memory engine, float64): membership 2 -> 4 -> 3 -> 2
with a failure midway equals an uninterrupted single-process run of the committed steps, for
every data-parallel strategy; joiners receive the commit; checkpoints restart at a new size."""
import copy
import re
import threading
import time

import pytest
import torch
from torch import nn

from distframe import spawn
from distframe.errors import ConfigError
from distframe.models import DDPModel, FSDPModel, ZeRO1Model, ZeRO2Model, ZeRO3Model
from distframe.optimizers.elastic import ElasticMember, ElasticOptimizer, latest_checkpoint
from distframe.optimizers.elastic_membership import ElasticController
from tests.optimizers.elastic_reference import adam_reference

torch.manual_seed(11)
MLP = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 2)).double()
GLOBAL_BATCH = 12  # divisible by 2, 3 and 4: the same global batch at every world size
LR = 0.01


def _global_batch(step):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=torch.float64)
    return x, torch.stack([x[:, 0].sin(), x[:, 1] * x[:, 2]], dim=1)


def _reference(steps):
    """Single-process Adam over the same global batches: the uninterrupted run."""
    return adam_reference(MLP, LR, range(steps), _global_batch)


class _WorkerDied(RuntimeError):
    pass


def _worker(strategy, total, *, fail_worker=None, fail_at=None, **elastic):
    def worker(backend, member):
        model = strategy(copy.deepcopy(MLP), backend)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, member=member, **elastic)
        restored = (opt.restored_from, opt.step_count)
        while opt.step_count < total and not opt.membership_changes:
            if member.worker_id == fail_worker and opt.step_count == fail_at:
                raise _WorkerDied(f"worker {fail_worker} died after step {fail_at}")
            model.train_step(opt.local_slice(_global_batch(opt.step_count)), nn.functional.mse_loss, opt)
        return opt.step_count, model.gather_full_parameters(), backend.world_size, restored
    return worker


def _max_diff(params, reference):
    return max((params[k] - v).abs().max().item() for k, v in reference.items())


@pytest.mark.parametrize("strategy", [DDPModel, ZeRO1Model, ZeRO2Model, ZeRO3Model, FSDPModel],
                         ids=lambda s: s.__name__)
def test_two_four_three_two_with_a_failure_equals_the_uninterrupted_run(strategy):
    total = 14
    # worker 3 joins at step 3 and dies after step 7; the last commit (every 2 steps) is step 6
    worker = _worker(strategy, total, fail_worker=3, fail_at=7, commit_every=2)
    controller = ElasticController(worker, initial_world=2, schedule={3: 4, 10: 2}, timeout=30)
    generations = controller.run()
    summary = [(len(g.members), g.start_step, g.end) for g in generations]
    assert summary == [(2, 0, "clean"), (4, 3, "failed"), (3, 6, "clean"), (2, 10, "finished")]
    assert generations[1].failed_worker == 3 and "died after step 7" in generations[1].error
    final = generations[-1].results
    assert [r[0] for r in final] == [total, total] and [r[2] for r in final] == [2, 2]
    reference = _reference(total)
    for _, params, _, _ in final:
        assert _max_diff(params, reference) <= 1e-10


def test_joiners_receive_the_commit_and_survivors_roll_back_to_it():
    restored = {}

    def worker(backend, member):
        model = DDPModel(copy.deepcopy(MLP), backend)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, member=member, commit_every=3)
        restored.setdefault(member.worker_id, []).append((opt.restored_from, opt.step_count))
        while opt.step_count < 9 and not opt.membership_changes:
            if member.worker_id == 2 and opt.step_count == 5:
                raise _WorkerDied("worker 2 died after step 5")
            model.train_step(opt.local_slice(_global_batch(opt.step_count)), nn.functional.mse_loss, opt)
        return opt.step_count
    generations = ElasticController(worker, initial_world=2, schedule={2: 3}, timeout=30).run()
    assert [(len(g.members), g.start_step, g.end) for g in generations] == [
        (2, 0, "clean"), (3, 2, "failed"), (2, 3, "finished")]
    assert restored[0][0] == ("initial state", 0)
    # the joiner got step 2's commit (the clean change commits) from rank 0 of the new group
    assert restored[2] == [("commit of step 2 (held by rank 0)", 2)]
    # after worker 2 died at step 5 the survivors rolled back to the commit of step 3 (every 3)
    assert restored[0][-1] == ("commit of step 3 (held by rank 0)", 3) == restored[1][-1]
    assert generations[-1].results == [9, 9]


def test_commit_is_complete_on_every_rank_for_sharded_state():
    """A ZeRO-1 commit holds every rank's optimizer shard, so any survivor can restore all."""
    def fn(b):
        model = ZeRO1Model(copy.deepcopy(MLP), b)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, commit_every=1)
        model.train_step(opt.local_slice(_global_batch(0)), nn.functional.mse_loss, opt)
        commit = opt.member.commit
        numel = sum(p.numel() for p in MLP.parameters())
        covered = sum(v.numel() for k, v in commit.optimizer["tensors"].items() if k.startswith("optim.exp_avg/"))
        return commit.step, covered == numel, sum(v.numel() for k, v in commit.model.items() if k.startswith("param/"))
    for step, complete, params in spawn(fn, 3, timeout=30):
        assert step == 1 and complete and params == sum(p.numel() for p in MLP.parameters())


def test_restart_from_checkpoint_at_a_new_world_size(tmp_path):
    """torchrun/mpiexec style: world 2 trains 6 steps checkpointing every 2nd commit and
    stops; a fresh world 3 with the same checkpoint_dir resumes at step 6 and finishes."""
    def first(b):
        model = ZeRO2Model(copy.deepcopy(MLP), b)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, commit_every=1, checkpoint_dir=tmp_path,
                               checkpoint_every=2)
        while opt.step_count < 7:
            model.train_step(opt.local_slice(_global_batch(opt.step_count)), nn.functional.mse_loss, opt)
        return opt.step_count
    assert spawn(first, 2, timeout=30) == [7, 7]
    assert latest_checkpoint(tmp_path).name == "step-6"  # commits 2, 4, 6 were checkpointed

    def second(b):
        model = FSDPModel(copy.deepcopy(MLP), b)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, checkpoint_dir=tmp_path)
        start = opt.step_count, opt.restored_from
        while opt.step_count < 10:
            model.train_step(opt.local_slice(_global_batch(opt.step_count)), nn.functional.mse_loss, opt)
        return start, model.gather_full_parameters()
    reference = _reference(10)
    for (start, source), params in spawn(second, 3, timeout=30):
        assert start == 6 and "step-6" in source
        assert _max_diff(params, reference) <= 1e-10


@pytest.mark.parametrize("kwargs, field", [({"commit_every": 0}, "commit_every"),
                                           ({"checkpoint_every": 2}, "checkpoint_dir"),
                                           ({"checkpoint_every": 0, "checkpoint_dir": "x"}, "checkpoint_every")])
def test_bad_settings_name_the_field(kwargs, field):
    def fn(b):
        with pytest.raises(ConfigError, match=field):
            ElasticOptimizer(DDPModel(copy.deepcopy(MLP), b), torch.optim.SGD, lr=0.1, **kwargs)
    spawn(fn, 1)


def test_uneven_global_batch_and_bad_schedule_are_config_errors():
    def fn(b):
        opt = ElasticOptimizer(DDPModel(copy.deepcopy(MLP), b), torch.optim.SGD, lr=0.1)
        with pytest.raises(ConfigError, match="split evenly"):
            opt.local_slice(torch.zeros(7, 6))
    spawn(fn, 2)
    with pytest.raises(ConfigError, match="schedule"):
        ElasticController(lambda b, m: None, initial_world=2, schedule={0: 3})
    assert ElasticMember(5).commit is None


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = copy.deepcopy(MLP)

    def forward(self, x, scale):
        return self.body(x) * scale


@pytest.mark.parametrize("packing", ["dict", "tuple"])
def test_local_slice_splits_inputs_given_as_a_dict_or_a_tuple_as_train_step_takes_them(packing):
    """train_step takes inputs as a dict or tuple (unpacked into the call): local_slice must
    slice every tensor in them (it raised AttributeError: 'dict' object has no attribute 'shape')."""
    def batch(step):
        x, y = _global_batch(step)
        scale = 1 + torch.arange(GLOBAL_BATCH, dtype=torch.float64).unsqueeze(1) / GLOBAL_BATCH
        return ({"x": x, "scale": scale} if packing == "dict" else (x, scale)), y

    def fn(b):
        model = DDPModel(_Scaled(), b)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR)
        for step in range(3):
            model.train_step(opt.local_slice(batch(step)), nn.functional.mse_loss, opt)
        return model.gather_full_parameters()
    reference = _Scaled()
    opt = torch.optim.Adam(reference.parameters(), lr=LR)
    for step in range(3):
        inputs, y = batch(step)
        opt.zero_grad()
        out = reference(**inputs) if packing == "dict" else reference(*inputs)
        nn.functional.mse_loss(out, y).backward()
        opt.step()
    for params in spawn(fn, 3, timeout=30):
        assert _max_diff(params, reference.state_dict()) <= 1e-12


@pytest.mark.parametrize("kwargs, needle", [
    ({"schedule": {True: 3}}, "schedule entry True: 3"),
    ({"schedule": {2: False}}, "schedule entry 2: False"),
    ({"max_generations": 0}, "max_generations=0"), ({"max_generations": True}, "max_generations=True"),
    ({"max_generations": 2.5}, "max_generations=2.5"), ({"timeout": 0}, "timeout=0"),
    ({"timeout": float("nan")}, "timeout=nan"), ({"timeout": True}, "timeout=True"),
])
def test_bad_controller_settings_name_the_field_and_the_fix(kwargs, needle):
    with pytest.raises(ConfigError, match=rf"{re.escape(needle)}.*: use "):
        ElasticController(lambda b, m: None, initial_world=2, **kwargs)


def test_elastic_demo_removes_and_adds_workers_and_logs_it():
    from distframe.optimizers.elastic_demo import run_elastic_demo
    lines = []
    generations = run_elastic_demo(lambda: copy.deepcopy(MLP), _global_batch, nn.functional.mse_loss,
                                   optimizer_cls=torch.optim.Adam, lr=LR, total_steps=8, initial_world=2,
                                   schedule={2: 3, 6: 2}, fail_worker=2, fail_at=4, commit_every=2,
                                   log=lines.append)
    assert [(len(g.members), g.start_step, g.end) for g in generations] == [
        (2, 0, "clean"), (3, 2, "failed"), (2, 4, "clean"), (2, 6, "finished")]
    assert any("worker 2 failed" in line for line in lines)
    assert any(line.startswith("step    8  world 2") for line in lines)
    # the last step's loss is the uninterrupted run's loss at that step
    model = copy.deepcopy(MLP)
    model.load_state_dict(_reference(7))
    with torch.no_grad():
        expected = float(nn.functional.mse_loss(model(_global_batch(7)[0]), _global_batch(7)[1]))
    assert generations[-1].results == pytest.approx([expected, expected], abs=1e-12)


def test_a_scheduler_resumed_with_last_epoch_follows_the_uninterrupted_schedule():
    """torch's idiom for resuming a scheduler, ``LambdaLR(opt, f, last_epoch=step - 1)``, needs
    the ``initial_lr`` the scheduler put on the param groups: the commit must bring it back, as
    ``torch.optim.Optimizer.load_state_dict`` does, for joiners and survivors alike."""
    def decay(step):
        return 1.0 / (1 + step)
    total = 6

    def worker(backend, member):
        model = ZeRO2Model(copy.deepcopy(MLP), backend)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, member=member)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, decay, last_epoch=opt.step_count - 1)
        while opt.step_count < total and not opt.membership_changes:
            model.train_step(opt.local_slice(_global_batch(opt.step_count)), nn.functional.mse_loss, opt)
            scheduler.step()
        return opt.param_groups[0]["lr"], model.gather_full_parameters()
    generations = ElasticController(worker, initial_world=2, schedule={3: 3}, timeout=30).run()
    reference = _scheduled_reference(decay, total)
    assert [len(g.members) for g in generations] == [2, 3]
    for lr, params in generations[-1].results:
        assert lr == pytest.approx(LR * decay(total), rel=1e-15)
        assert _max_diff(params, reference.state_dict()) <= 1e-10


def _scheduled_reference(decay, total: int) -> nn.Module:
    """MLP after ``total`` single-process Adam steps on the global batches under LambdaLR(decay)."""
    reference = copy.deepcopy(MLP)
    opt = torch.optim.Adam(reference.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    for step in range(total):
        x, y = _global_batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        opt.step()
        scheduler.step()
    return reference


def test_an_lr_scheduler_owned_by_the_optimizer_is_restored_from_commits():
    """A scheduler built by ``lr_scheduler=`` is stepped inside ``step()`` before the commit, so
    joiners (step 3) and survivors rolled back after a failure (worker 2 dies after step 5; the
    last commit, every 2 steps, is step 4) hold its state and rates: the run follows the
    uninterrupted schedule, although no worker passes last_epoch."""
    def decay(step):
        return 1.0 / (1 + step)
    total = 7

    def worker(backend, member):
        model = ZeRO2Model(copy.deepcopy(MLP), backend)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, member=member, commit_every=2,
                               lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, decay))
        while opt.step_count < total and not opt.membership_changes:
            if member.worker_id == 2 and opt.step_count == 5:
                raise _WorkerDied("worker 2 died after step 5")
            model.train_step(opt.local_slice(_global_batch(opt.step_count)), nn.functional.mse_loss, opt)
        return opt.lr_scheduler.last_epoch, opt.param_groups[0]["lr"], model.gather_full_parameters()
    generations = ElasticController(worker, initial_world=2, schedule={3: 3}, timeout=30).run()
    assert [(len(g.members), g.start_step, g.end) for g in generations] == [
        (2, 0, "clean"), (3, 3, "failed"), (2, 4, "finished")]
    reference = _scheduled_reference(decay, total)
    for last_epoch, lr, params in generations[-1].results:
        assert last_epoch == total and lr == pytest.approx(LR * decay(total), rel=1e-15)
        assert _max_diff(params, reference.state_dict()) <= 1e-10


def test_an_lr_scheduler_that_is_not_a_builder_is_a_config_error():
    def fn(b):
        opt = torch.optim.SGD(MLP.parameters(), lr=0.1)
        with pytest.raises(ConfigError, match="lr_scheduler: pass a function"):
            ElasticOptimizer(DDPModel(copy.deepcopy(MLP), b), torch.optim.SGD, lr=0.1,
                             lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    spawn(fn, 1)


@pytest.mark.timeout(60)
def test_a_worker_that_returns_early_is_named_at_once_and_its_peers_are_not_dropped():
    """Worker 1 returns before the membership change while its peers wait for it in a
    collective: they must stop at once (not after the 30 s timeout), and the run must end with
    an error naming worker 1, not drop the peers as failed and go on with worker 1 alone."""
    def worker(backend, member):
        model = DDPModel(copy.deepcopy(MLP), backend)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, member=member)
        while opt.step_count < 6 and not opt.membership_changes:
            if member.worker_id == 1 and opt.step_count == 2:
                return "left"
            model.train_step(opt.local_slice(_global_batch(opt.step_count)), nn.functional.mse_loss, opt)
        return opt.step_count
    controller = ElasticController(worker, initial_world=3, schedule={4: 2}, timeout=30)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker 1 returned .*membership_changes"):
        controller.run()
    assert time.monotonic() - start < 15
    assert len(controller.generations) == 1


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stall", ["hangs", "is_late"])
def test_a_hung_or_late_worker_is_dropped_and_its_peers_go_on(stall):
    """Worker 2 stalls after step 2, outside any collective: its peers' collective times out
    naming it as missing. The controller must drop worker 2, not the peers that timed out; must
    not wait for a thread that never returns ("hangs") without bound; and the survivors must
    finish from the last commit. "is_late" wakes after the peers' timeout and meets the aborted
    group in its next collective."""
    release = threading.Event()
    total = 6

    def worker(backend, member):
        model = DDPModel(copy.deepcopy(MLP), backend)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, member=member)
        while opt.step_count < total and not opt.membership_changes:
            if member.worker_id == 2 and opt.step_count == 2:
                if stall == "hangs":
                    release.wait()  # until the test ends
                    return "released"
                time.sleep(3)
            model.train_step(opt.local_slice(_global_batch(opt.step_count)), nn.functional.mse_loss, opt)
        return opt.step_count, model.gather_full_parameters()
    controller = ElasticController(worker, initial_world=3, timeout=2)
    start = time.monotonic()
    try:
        generations = controller.run()
    finally:
        release.set()
    assert time.monotonic() - start < 45  # two 2 s timeouts and the training, not forever
    assert [(g.members, g.start_step, g.end) for g in generations] == [
        ([0, 1, 2], 0, "failed"), ([0, 1], 2, "finished")]
    assert generations[0].failed_worker == 2 and "worker 2" in generations[0].error
    if stall == "hangs":
        assert "hung" in generations[0].error
    reference = _reference(total)
    for steps, params in generations[-1].results:
        assert steps == total and _max_diff(params, reference) <= 1e-10


@pytest.mark.timeout(90)
def test_a_worker_stalled_in_a_zero3_backward_is_the_one_dropped():
    """Worker 1 stalls in its backward: its peers' reduce_scatter times out, and the all_gather
    prefetched behind it is refused. Before, that refusal was a plain DistFrameError, which the
    controller took for the peers' own failure: it dropped workers 0 and 2 and went on with 1."""
    release = threading.Event()
    total = 5

    def worker(backend, member):
        model = ZeRO3Model(copy.deepcopy(MLP), backend)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, member=member)

        def stall(module, inputs, output):
            if member.worker_id == 1 and opt.step_count == 2 and output.requires_grad:
                output.register_hook(lambda grad: release.wait(60))
        model.wrapped_model[3].register_forward_hook(stall)
        while opt.step_count < total and not opt.membership_changes:
            model.train_step(opt.local_slice(_global_batch(opt.step_count)), nn.functional.mse_loss, opt)
        return opt.step_count, model.gather_full_parameters()
    controller = ElasticController(worker, initial_world=3, timeout=2)
    try:
        generations = controller.run()
    finally:
        release.set()
    assert [(g.members, g.start_step, g.end) for g in generations] == [
        ([0, 1, 2], 0, "failed"), ([0, 2], 2, "finished")]
    assert generations[0].failed_worker == 1
    reference = _reference(total)
    for steps, params in generations[-1].results:
        assert steps == total and _max_diff(params, reference) <= 1e-10


@pytest.mark.parametrize("kwargs", [{"member": "x"}, {"checkpoint_dir": 123, "checkpoint_every": 1}],
                         ids=["member", "checkpoint_dir"])
def test_a_member_or_checkpoint_dir_of_another_type_is_a_config_error(kwargs):
    """They failed later with 'str' object has no attribute 'commit', or Path's TypeError."""
    def fn(b):
        with pytest.raises(ConfigError, match=r"pass an ElasticMember \(or None\) and a directory path"):
            ElasticOptimizer(DDPModel(nn.Linear(2, 2).double(), b), torch.optim.SGD, lr=0.1, **kwargs)
    spawn(fn, 1, timeout=10)
