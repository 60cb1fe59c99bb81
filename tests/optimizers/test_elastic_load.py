"""A state loaded by hand into an ElasticOptimizer (``distframe.checkpoint.load`` or
``load_state_dict``) is committed, so a later failure rolls the survivors back to it, not to the
commit from before the load (in-memory engine, float64, ZeRO-2: the failed worker's shard of
the loaded state must come from the commit)."""
import copy
import threading

import pytest
import torch
from torch import nn

from distframe import checkpoint, spawn
from distframe.models import DDPModel, ZeRO2Model
from distframe.optimizers.elastic import ElasticOptimizer, ElasticRollbackError
from distframe.optimizers.elastic_membership import ElasticController
from tests.optimizers.elastic_reference import adam_reference

torch.manual_seed(8)
MLP = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 2)).double()
LR = 0.01
TOTAL = 7
OTHER = 100  # the loaded state was trained on batches 100, 101, ...: another trajectory


def _batch(step):
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randn(12, 5, generator=g, dtype=torch.float64)
    return x, x[:, 1:3].sin()


def _train(model, opt, steps, offset=0):
    while opt.step_count < steps:
        model.train_step(opt.local_slice(_batch(offset + opt.step_count)), nn.functional.mse_loss, opt)


def _reference(batches):
    return adam_reference(MLP, LR, batches, _batch)


def _other_state(tmp_path):
    """4 steps on the other batches, as a checkpoint and as merged state dicts."""
    def fn(b):
        model = ZeRO2Model(copy.deepcopy(MLP), b)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR)
        _train(model, opt, 4, offset=OTHER)
        checkpoint.save(tmp_path / "other", model, opt)
        return model.gather_full_parameters(), opt.state_dict()
    results = spawn(fn, 2, timeout=30)
    merged = {"tensors": {}, "scalars": {}, "param_groups": results[0][1]["param_groups"],
              "step_count": results[0][1]["step_count"]}
    for _, state in results:
        merged["tensors"].update(state["tensors"])
        merged["scalars"].update(state["scalars"])
    return tmp_path / "other", results[0][0], merged


def _load(how, model, opt, other):
    """``how``: checkpoint.load or load_state_dict, of the model and optimizer, or of the model
    alone ("model ..."; pretrained weights loaded right after the optimizer was built)."""
    path, params, optimizer_state = other
    if how == "checkpoint.load":
        checkpoint.load(path, model, opt)
    elif how == "model checkpoint.load":
        checkpoint.load(path, model)
    else:
        model.load_state_dict(params)
        if how == "load_state_dict":
            opt.load_state_dict(optimizer_state)


@pytest.mark.parametrize("how", ["checkpoint.load", "load_state_dict"])
def test_survivors_of_a_failure_resume_from_a_state_loaded_by_hand(tmp_path, how):
    """Commits every 4 steps: step 0, then the load (at step 1) jumps to step 4 and worker 2
    dies after step 5. Before, the survivors rolled back to the commit of step 0, from before
    the load: the loaded state was lost and the step count jumped back."""
    other = _other_state(tmp_path)
    loaded = threading.Event()
    restored = {}

    def worker(backend, member):
        model = ZeRO2Model(copy.deepcopy(MLP), backend)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, member=member, commit_every=4)
        restored.setdefault(member.worker_id, []).append(opt.step_count)
        if not loaded.is_set():
            _train(model, opt, 1)
            _load(how, model, opt, other)
            backend.barrier()
            loaded.set()
        while opt.step_count < TOTAL:
            if member.worker_id == 2 and opt.step_count == 5:
                raise RuntimeError("worker 2 died after step 5")
            _train(model, opt, opt.step_count + 1)
        return model.gather_full_parameters()
    generations = ElasticController(worker, initial_world=3, timeout=30).run()
    assert [(len(g.members), g.start_step, g.end) for g in generations] == [
        (3, 0, "failed"), (2, 4, "finished")]
    assert restored[0] == restored[1] == [0, 4]
    reference = _reference([OTHER + s for s in range(4)] + list(range(4, TOTAL)))
    for params in generations[-1].results:
        assert max((params[k] - v).abs().max().item() for k, v in reference.items()) <= 1e-10


@pytest.mark.parametrize("how,commit_at_once", [
    ("load_state_dict", False), ("load_state_dict", True), ("checkpoint.load", False),
    ("model checkpoint.load", False), ("model load_state_dict", False)])
def test_a_failure_before_the_load_is_committed_is_not_silent(tmp_path, how, commit_at_once):
    """checkpoint.load commits what it loaded into the model and optimizer once its ranks agree
    that every read worked; the next step() commits a load through load_state_dict, or of the
    model's weights alone. A worker that dies between such a load and that step would roll the
    survivors back to before the load: the run stops instead, unless the user committed the
    load at once with commit()."""
    other = _other_state(tmp_path)
    loaded = threading.Event()

    def worker(backend, member):
        model = ZeRO2Model(copy.deepcopy(MLP), backend)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, member=member, commit_every=4)
        if not loaded.is_set():
            _load(how, model, opt, other)
            if commit_at_once:
                opt.commit()
            backend.barrier()
            loaded.set()
            if member.worker_id == 2:
                raise RuntimeError("worker 2 died right after the load")
        _train(model, opt, TOTAL)
        return opt.step_count
    controller = ElasticController(worker, initial_world=3, timeout=30)
    if commit_at_once or how == "checkpoint.load":
        generations = controller.run()
        assert [g.start_step for g in generations] == [0, 4]
        assert generations[-1].results == [TOTAL, TOTAL]
        return
    with pytest.raises(ElasticRollbackError, match=r"loaded by hand at step \d.*not committed.*commit\(\)"):
        controller.run()
    assert len(controller.generations) == 2


def test_a_restore_from_a_checkpoint_commits_once(tmp_path):
    """The restore loads the checkpoint and commits it: the first step must not commit again."""
    def first(b):
        model = DDPModel(copy.deepcopy(MLP), b)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, checkpoint_dir=tmp_path, checkpoint_every=2)
        _train(model, opt, 2)

    def second(b):
        model = DDPModel(copy.deepcopy(MLP), b)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, checkpoint_dir=tmp_path, commit_every=100)
        b.stats.reset()
        _train(model, opt, 3)
        return opt.step_count, b.stats.calls.get("all_gather", 0)
    spawn(first, 2, timeout=30)
    assert spawn(second, 2, timeout=30) == [(3, 0), (3, 0)]


def test_committing_a_load_does_not_save_the_checkpoint_again(tmp_path):
    """Only a step's commit saves a checkpoint (every checkpoint_every commits): the commit of a
    checkpoint just loaded, at a step that is a multiple of the interval, used to write the
    same checkpoint again (a new directory renamed over the one just read)."""
    def fn(b):
        model = DDPModel(copy.deepcopy(MLP), b)
        opt = ElasticOptimizer(model, torch.optim.Adam, lr=LR, checkpoint_dir=tmp_path, checkpoint_every=1)
        _train(model, opt, 2)
        b.barrier()
        before = (tmp_path / "step-1").stat().st_ino
        checkpoint.load(tmp_path / "step-1", model, opt)
        opt.commit()
        b.barrier()
        return before == (tmp_path / "step-1").stat().st_ino, opt.member.commit.step
    assert spawn(fn, 2, timeout=30) == [(True, 1), (True, 1)]
