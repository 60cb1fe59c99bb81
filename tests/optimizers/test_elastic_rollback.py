"""ElasticController when every worker that held the newest commit fails (in-memory engine,
float64): the run must not start over, nor go back to an older checkpoint, without a word. It
stops with ElasticRollbackError naming what was lost, unless a checkpoint holds the lost step
or the user opted in with ``allow_rollback=True`` (then a warning names the steps lost)."""
import copy
import shutil

import pytest
import torch
from torch import nn

from distframe.models import DDPModel
from distframe.optimizers.elastic import ElasticOptimizer, ElasticRollbackError
from distframe.optimizers.elastic_membership import ElasticController
from tests.optimizers.elastic_reference import adam_reference

torch.manual_seed(3)
MLP = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).double()
LR = 0.01
TOTAL = 6


def _batch(step):
    g = torch.Generator().manual_seed(700 + step)
    x = torch.randn(8, 5, generator=g, dtype=torch.float64)
    return x, x[:, :2].cos()


def _reference(steps):
    return adam_reference(MLP, LR, range(steps), _batch)


class _WorkerDied(RuntimeError):
    pass


def _holders_fail_when_the_world_grows(**elastic):
    """World 2 grows to 4 at the scheduled step; in the group of 4 the two workers that held the
    commit (0 and 1) die before the joiners (2 and 3) receive it, so the joiners hold nothing."""
    restored = {}

    def worker(backend, member):
        if backend.world_size == 4 and member.worker_id in (0, 1):
            raise _WorkerDied(f"worker {member.worker_id} died before the restore")
        model = DDPModel(copy.deepcopy(MLP), backend)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, member=member, **elastic)
        restored.setdefault(member.worker_id, []).append((opt.restored_from, opt.step_count))
        while opt.step_count < TOTAL and not opt.membership_changes:
            model.train_step(opt.local_slice(_batch(opt.step_count)), nn.functional.mse_loss, opt)
        return opt.step_count, model.gather_full_parameters()
    return worker, restored


def test_the_run_stops_when_every_holder_of_the_newest_commit_failed():
    """Before: the joiners restored "initial state" and trained again from step 0, silently."""
    worker, restored = _holders_fail_when_the_world_grows()
    controller = ElasticController(worker, initial_world=2, schedule={3: 4}, timeout=30)
    with pytest.raises(ElasticRollbackError) as caught:
        controller.run()
    message = str(caught.value)
    assert "commit of step 3" in message and "steps 1 to 3" in message
    assert "checkpoint_dir" in message and "allow_rollback" in message
    assert len(controller.generations) == 3  # stopped at once, not after max_generations
    assert [g.end for g in controller.generations[:2]] == ["clean", "failed"]
    assert 2 not in restored and 3 not in restored  # the joiners never went on


def test_a_checkpoint_of_the_lost_step_is_restored_without_loss(tmp_path):
    worker, restored = _holders_fail_when_the_world_grows(checkpoint_dir=tmp_path, checkpoint_every=1)
    generations = ElasticController(worker, initial_world=2, schedule={3: 4}, timeout=30).run()
    assert [(g.members, g.start_step, g.end) for g in generations] == [
        ([0, 1], 0, "clean"), ([0, 1, 2, 3], 3, "failed"), ([2, 3], 3, "finished")]
    assert restored[2] == [(f"checkpoint {tmp_path / 'step-3'}", 3)]
    reference = _reference(TOTAL)
    for steps, params in generations[-1].results:
        assert steps == TOTAL
        assert max((params[k] - v).abs().max().item() for k, v in reference.items()) <= 1e-10


def test_an_older_checkpoint_is_refused_unless_the_user_allows_the_rollback(tmp_path):
    """Commits at steps 1, 2, 3, checkpoints at 2 only: going on from step-2 loses step 3."""
    worker, _ = _holders_fail_when_the_world_grows(checkpoint_dir=tmp_path, checkpoint_every=2)
    with pytest.raises(ElasticRollbackError, match=r"commit of step 3.*restart from the checkpoint "
                                                   r"of step 2"):
        ElasticController(worker, initial_world=2, schedule={3: 4}, timeout=30).run()

    for child in tmp_path.iterdir():  # start the run again, from nothing
        shutil.rmtree(child)
    worker, restored = _holders_fail_when_the_world_grows(checkpoint_dir=tmp_path, checkpoint_every=2,
                                                          allow_rollback=True)
    with pytest.warns(RuntimeWarning, match=r"step 3 .*lost.*going on from .*step-2"):
        generations = ElasticController(worker, initial_world=2, schedule={3: 4}, timeout=30).run()
    assert restored[2] == [(f"checkpoint {tmp_path / 'step-2'} (rolled back from step 3)", 2)]
    assert [g.end for g in generations] == ["clean", "failed", "finished"]
    assert [r[0] for r in generations[-1].results] == [TOTAL, TOTAL]


def test_allow_rollback_must_be_a_bool():
    from distframe import spawn
    from distframe.errors import ConfigError

    def fn(b):
        with pytest.raises(ConfigError, match="allow_rollback=1"):
            ElasticOptimizer(DDPModel(copy.deepcopy(MLP), b), torch.optim.SGD, lr=0.1, allow_rollback=1)
    spawn(fn, 1)
