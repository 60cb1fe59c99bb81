"""ElasticOptimizer: data-parallel training whose workers may leave, fail or join.

State lives in *commits*: ``commit()`` snapshots the model and optimizer state of every rank
(the sharded pieces of ``state_dict()``, keyed by parameter range), with the lr scheduler's and
the GradScaler's, into one ``Commit`` (elastic_commit.py) that every rank holds, so the
survivors of any failure hold all of it, and (every ``checkpoint_every`` commits) writes a
checkpoint. Building an ElasticOptimizer in a new group restores the newest commit any member
holds (one broadcast from a member that has it, so a joining worker receives it) and re-shards
it for the new world size through the strategies' range-keyed ``load_state_dict``; with no
commit in memory it resumes from the newest checkpoint in ``checkpoint_dir`` (a torchrun/mpiexec
restart at a new world size), else starts fresh and commits step 0. It never goes back
silently: when the members know the run's newest commit (``ElasticMember.newest_committed_step``,
set by ElasticController) and every worker that held it failed, it restores a checkpoint of that
step, or raises ElasticRollbackError naming the steps that would be lost (``allow_rollback=True``:
goes on from the newest older state, with a warning). Works with DDP, ZeRO-1/2/3 and FSDP models
and refuses others (ConfigError): pipeline, tensor and hybrid ranks share a data-parallel slice.

How membership changes on the in-memory engine is ``elastic_membership.py``.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from distframe.backends.objects import all_gather_bytes, broadcast_bytes
from distframe.errors import ConfigError
from distframe.models.base import ShardedModelBase
from distframe.models.ddp import DDPModel
from distframe.models.fsdp import FSDPModel
from distframe.models.sharded_state import RangeReader
from distframe.models.zero import ZeRO1Model, ZeRO2Model
from distframe.models.zero3 import ZeRO3Model
from distframe.optimizers.agreed_settings import check_same_settings, optimizer_settings
from distframe.optimizers.base import ShardedOptimizerBase
from distframe.optimizers.elastic_commit import Commit, ElasticMember
from distframe.optimizers.elastic_grad_scaler import CommittedGradScaler, refuse_unregistered
from distframe.optimizers.elastic_rollback import (ElasticRollbackError, describe_source,
                                                  latest_checkpoint, latest_checkpoint_and_step,
                                                  lost_commit, unsaved_load)
from distframe.optimizers.owned_scheduler import (build_scheduler, group_settings,
                                                   restore_group_settings, scheduler_state)
from distframe.optimizers.sharded_state import hyperparameters

__all__ = ["Commit", "ElasticMember", "ElasticOptimizer", "ElasticRollbackError", "latest_checkpoint",
           "latest_checkpoint_and_step"]

# What local_slice's split of the batch over every rank, and resharding by the strategy's
# range-keyed state, are exact for; model-parallel ranks share a data-parallel slice.
_DATA_PARALLEL_MODELS = (DDPModel, ZeRO1Model, ZeRO2Model, ZeRO3Model, FSDPModel)


class ElasticOptimizer(ShardedOptimizerBase):
    """Wraps a torch.optim optimizer over any data-parallel model (DDPModel, ZeRO1Model,
    ZeRO2Model, ZeRO3Model, FSDPModel; ConfigError for a model-parallel one); ``step()`` behaves
    as that strategy's optimizer.

    ``commit_every``: commit after every that many steps (and always at ``member.until_step``).
    ``checkpoint_dir`` / ``checkpoint_every``: every that many regular commits (at steps that are
    multiples of commit_every * checkpoint_every) also save a checkpoint
    ``<checkpoint_dir>/step-<N>`` (distframe.checkpoint). ``member``: this worker's
    ``ElasticMember`` (None: a fresh one). Construction is collective (the restore).
    ``allow_rollback``: when every worker that held the run's newest commit failed and no
    checkpoint of its step exists, go on from the newest older state (a checkpoint, an older
    commit, or the initial state) with a RuntimeWarning naming the steps lost, instead of
    raising ElasticRollbackError (so too for a load by hand not yet committed, below); every
    worker of the group must pass True. ``read_rank_state``: passed on to checkpoint.load when the
    restore loads a checkpoint, to read what its save's ``rank_state`` stored for this rank (a
    training job's generator states; a commit holds none).

    A state loaded by hand is committed: by ``distframe.checkpoint.load(path, model, optimizer)``
    once its ranks agree that every read worked (``finish_load``); after the model's or this
    optimizer's ``load_state_dict``, or ``checkpoint.load(path, model)`` (weights alone), by the
    next ``step()``, before it steps. A failure before
    that step stops the restore with ElasticRollbackError; call ``commit()`` right after such a
    load to commit it at once.

    ``lr_scheduler``: a function that builds a torch learning-rate scheduler on this optimizer
    (``lambda opt: LambdaLR(opt, f)``). The optimizer then owns it, as DeepSpeed's engine does:
    ``step()`` steps it after each optimizer step and before the commit, so every commit holds
    the scheduler's state (``state_dict``, JSON) consistent with the optimizer's, and survivors
    and joiners get it back (as Horovod's elastic State restores the objects it holds); do not
    step it yourself. Checkpoints hold it too (``state_dict()`` adds the scheduler's state and
    ``step_count``), so a restart from one resumes the schedule where it was. It is built after
    the restore, then given the restored state and group settings (the lr, and the momentum or
    betas OneCycleLR and CyclicLR set). One whose ``step()`` needs a metric (ReduceLROnPlateau)
    is refused with ConfigError: step such a scheduler yourself, after validation.

    ``grad_scaler``: the GradScaler that drives the steps (DDP: a plain ``torch.amp.GradScaler``
    or ``distframe.ShardedGradScaler``; ZeRO, FSDP: ShardedGradScaler), used as usual
    (``scaler.scale(loss).backward()``, ``scaler.step(optimizer)``, ``scaler.update()``). Its state
    is part of every commit and checkpoint, as the scheduler's is: joiners receive the scale,
    survivors rolled back and restarts get back the scale of what they restore, so every rank
    uses the same scale at every step (elastic_grad_scaler.py). A scaler that drives the steps
    without being registered is noticed (a GradScaler hands ``step()`` its found-inf flag), and
    restoring a commit made under it (a membership change, a rollback) raises ConfigError rather
    than let the replicas diverge; so do ranks whose scalers' states differ at a commit. A step
    the scaler skips, on every rank alike, does not count in ``step_count``, step the scheduler
    or commit.

    Collectives: ``commit()`` two all_gathers (sizes, then the serialised pieces); construction
    one all_gather of a digest of the settings (ConfigError on every rank, naming what differs,
    for ranks built with other param groups, commit_every, checkpointing or scheduler), one
    all_gather (each member's committed step, the run's newest step, any load not yet
    committed, allow_rollback) and, when a member's commit is restored, two broadcasts; a
    checkpoint restored is loaded (distframe.checkpoint.load), then committed; the first
    ``step()`` after a load by hand commits it first.
    ``step_count`` is the number of optimizer steps the model has taken, across restarts.
    """

    def __init__(self, model: ShardedModelBase, optimizer: Any, *, commit_every: int = 1,
                 checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None,
                 member: ElasticMember | None = None,
                 lr_scheduler: Callable[[ElasticOptimizer], Any] | None = None,
                 grad_scaler: torch.amp.GradScaler | None = None,
                 allow_rollback: bool = False,
                 read_rank_state: Callable[[dict[str, Any], RangeReader], None] | None = None,
                 **optimizer_kwargs: Any) -> None:
        _refuse_model_parallel(model)
        if isinstance(commit_every, bool) or not isinstance(commit_every, int) or commit_every < 1:
            raise ConfigError(f"ElasticOptimizer commit_every={commit_every!r}: use a positive int (steps)")
        if checkpoint_every is not None and (isinstance(checkpoint_every, bool) or not isinstance(
                checkpoint_every, int) or checkpoint_every < 1):
            raise ConfigError(f"ElasticOptimizer checkpoint_every={checkpoint_every!r}: use a positive "
                              "int (commits between checkpoints) or None")
        if lr_scheduler is not None and not callable(lr_scheduler):
            raise ConfigError("ElasticOptimizer lr_scheduler: pass a function that builds the scheduler "
                              "on the optimizer, such as lambda opt: LambdaLR(opt, f)")
        if checkpoint_every is not None and checkpoint_dir is None:
            raise ConfigError("ElasticOptimizer checkpoint_every needs checkpoint_dir=<directory>")
        if not isinstance(allow_rollback, bool):
            raise ConfigError(f"ElasticOptimizer allow_rollback={allow_rollback!r}: use True or False")
        if not (member is None or isinstance(member, ElasticMember)) or not (
                checkpoint_dir is None or isinstance(checkpoint_dir, (str, os.PathLike))):
            raise ConfigError(f"ElasticOptimizer member={member!r:.30} checkpoint_dir={checkpoint_dir!r:.30}:"
                              " pass an ElasticMember (or None) and a directory path (or None)")
        scaler = CommittedGradScaler(grad_scaler, model)
        super().__init__(model, optimizer, **optimizer_kwargs)
        # Before the restore: a commit would give every rank rank 0's groups, but a fresh start
        # keeps each rank's own, and the replicas would drift apart.
        check_same_settings(model.backend, {
            **optimizer_settings(self.wrapped_optimizer), "commit_every": commit_every,
            "checkpoint_every": checkpoint_every, "checkpoint_dir_given": checkpoint_dir is not None,
            "lr_scheduler_given": lr_scheduler is not None}, "ElasticOptimizer")
        self._scaler = scaler
        self.commit_every = commit_every
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.checkpoint_every = checkpoint_every
        self.allow_rollback = allow_rollback
        self._read_rank_state = read_rank_state
        self.member = member or ElasticMember(model.backend.rank)
        self.step_count = 0
        self.lr_scheduler = None
        self._loaded_scheduler: dict[str, Any] | None = None  # loaded before the scheduler existed
        self._restoring = True  # the restore commits what it loads itself (finish_load)
        self.restored_from = self._restore()
        self._restoring = False
        if lr_scheduler is not None:
            self._own_scheduler(lr_scheduler)
        self._loaded_scheduler = None

    def _own_scheduler(self, builder: Callable[[ElasticOptimizer], Any]) -> None:
        """Builds the scheduler on the restored state and gives it its saved state back, with
        the group settings restored ([Note: a scheduler built after the state it continues])."""
        restored = group_settings(self.param_groups)
        self.lr_scheduler = build_scheduler(builder, self, "ElasticOptimizer",
                                            "step it yourself after validation")
        saved = self.member.commit.lr_scheduler or self._loaded_scheduler
        if saved is not None:
            self.lr_scheduler.load_state_dict(saved)
            restore_group_settings(self.param_groups, restored)
        # The commit made while restoring (from a checkpoint, or the initial one) predates the
        # scheduler: survivors rolled back to it must get the scheduler's state, and the group
        # settings its building wrote (a fresh OneCycleLR's momentum), too. Every rank built and
        # loaded the same scheduler, so this needs no collective.
        commit = self.member.commit
        groups = [{**saved_group, **now} for saved_group, now in
                  zip(commit.optimizer["param_groups"], hyperparameters(self.wrapped_optimizer))]
        self.member.commit = dataclasses.replace(
            commit, lr_scheduler=self._scheduler_state(),
            optimizer={**commit.optimizer, "param_groups": groups})

    def model_loaded(self) -> None:
        """Called by the model at the end of each of its loads: the next ``step()`` commits the
        new weights (``finish_load`` at once, when checkpoint.load loaded this optimizer too)."""
        if not self._restoring:
            self.member.loaded_step = self.step_count

    def finish_load(self) -> None:
        """Called by ``distframe.checkpoint.load`` on every rank once every rank's read worked:
        commits the loaded state (collective; the restore commits its own loads)."""
        if self.member.loaded_step is not None and not self._restoring:
            self.commit()

    # ---- training ---------------------------------------------------------------------------
    def step(self, closure: Any = None) -> Any:
        """Commits a state loaded by hand first (see the class docstring), then steps."""
        if self.member.loaded_step is not None:
            self.commit()
        return super().step(closure)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # Over DDP too (the base class leaves DDP to torch's own path): a GradScaler then hands
        # step() its flag, so this optimizer knows that one drives it, registered or not.
        return True

    def _apply_grad_scaler(self) -> bool:
        if getattr(self, "found_inf", None) is not None:
            self._scaler.saw_scaled_step(self)
        if not self.model.replicates_gradients:
            return super()._apply_grad_scaler()
        with self.agreed_scaler_step():  # DDP: every rank finds the same in the same averaged gradients
            return super()._apply_grad_scaler()

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler passed as ``grad_scaler=`` (None: none)."""
        return self._scaler.scaler

    def _step(self, closure: Any = None) -> Any:
        # Not step(): a step a GradScaler skips (on every rank alike) counts and commits nothing.
        loss = super()._step(closure)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.step_count += 1
        if self.step_count % self.commit_every == 0 or self.step_count == self.member.until_step:
            self.commit()
            # Only a step's commit saves: committing a load or a restore must not write the
            # checkpoint it has just read over again.
            interval = None if self.checkpoint_every is None else self.checkpoint_every * self.commit_every
            if interval is not None and self.step_count % interval == 0:
                from distframe.checkpoint import save
                save(self.checkpoint_dir / f"step-{self.step_count}", self.model, self, step=self.step_count)
        return loss

    @property
    def membership_changes(self) -> bool:
        """True once this group has reached the step at which its membership changes."""
        return self.member.until_step is not None and self.step_count >= self.member.until_step

    def local_slice(self, global_batch: Any) -> Any:
        """This rank's equal share (dim 0) of a global batch, which must divide evenly by the
        world size, so the global batch is the same for every world size. The batch is a tensor
        or (as ``train_step`` takes it) tuples, lists and dicts of them, such as
        ``({"input_ids": ..., "mask": ...}, targets)``; other values are passed on whole."""
        backend = self.model.backend
        return _slice_batch(global_batch, backend.rank, backend.world_size)

    # ---- commits ------------------------------------------------------------------------------
    def commit(self) -> Commit:
        """Snapshots every rank's state into one Commit held by every rank; collective."""
        backend = self.model.backend
        state = self.state_dict()
        mine = Commit(self.step_count, dict(self.model.state_dict()), state, backend.world_size,
                      state["lr_scheduler"], state["grad_scaler"], self._scaler.unregistered)
        blobs = all_gather_bytes(backend, mine.to_bytes())
        commit = Commit.merge([Commit.from_bytes(b) for b in blobs])
        self.member.commit = commit
        self.member.loaded_step = None
        return commit

    def _restore(self) -> str:
        """Loads the newest commit any member holds, else the newest checkpoint, else commits
        the initial state, never going behind the run's newest commit without saying so (see
        the module docstring). Returns where the state came from."""
        backend = self.model.backend
        member = self.member
        mine = [member.commit.step if member.commit is not None else -1,
                _or_minus_one(member.newest_committed_step), _or_minus_one(member.loaded_step),
                int(self.allow_rollback)]
        rows = backend.all_gather(torch.tensor(mine, dtype=torch.int64)).view(backend.world_size, 4)
        held, required, loaded = rows[:, 0], int(rows[:, 1].max()), int(rows[:, 2].max())
        allow, newest = bool(rows[:, 3].min()), int(held.max())
        found = latest_checkpoint_and_step(self.checkpoint_dir)
        # A commit held wins, unless it is behind the run's newest and a checkpoint is newer.
        from_commit = newest >= 0 and (newest >= required or found is None or newest >= found[1])
        step = newest if from_commit else found[1] if found is not None else 0
        source = describe_source(newest if from_commit else None, found)
        if step < required:
            self._roll_back(lost_commit(required, step, source, found, self.checkpoint_dir, allow), allow)
        if loaded >= 0:
            self._roll_back(unsaved_load(loaded, source, allow), allow)
        rolled = f" (rolled back from step {required})" if step < required else ""
        if from_commit:
            return self._restore_commit(held, newest) + rolled
        if found is not None:
            from distframe.checkpoint import load
            meta = load(found[0], self.model, self,  # sets step_count (and the scheduler's state)
                        read_rank_state=self._read_rank_state)
            if meta["optimizer"].get("extra", {}).get("step_count") is None:  # older checkpoints
                self.step_count = int(meta["step"])
            self.commit()
            return f"checkpoint {found[0]}{rolled}"
        self.commit()
        return "initial state" + rolled

    def _restore_commit(self, held: torch.Tensor, newest: int) -> str:
        """Broadcasts the commit of step ``newest`` from the first rank that holds it; loads it."""
        backend = self.model.backend
        source = int((held == newest).nonzero()[0])
        blob = self.member.commit.to_bytes() if backend.rank == source else b""
        commit = Commit.from_bytes(broadcast_bytes(backend, blob, source))
        self.load_commit(commit)
        return f"commit of step {commit.step} (held by rank {source})"

    def _roll_back(self, message: str, allow: bool) -> None:
        """Raises ElasticRollbackError, or with allow_rollback warns (once, on rank 0)."""
        if not allow:
            raise ElasticRollbackError(f"ElasticOptimizer: {message}")
        if self.model.backend.rank == 0:
            warnings.warn(f"ElasticOptimizer (allow_rollback=True): {message}", RuntimeWarning,
                          stacklevel=4)

    def load_commit(self, commit: Commit) -> None:
        """Re-shards ``commit`` onto this model and optimizer (any saved world size); collective
        for strategies whose load gathers parameters. ConfigError (on every rank alike) for a
        commit made while an unregistered GradScaler drove the steps."""
        if commit.unregistered_scaler:
            refuse_unregistered(commit.step)
        self.model.load_state_dict(RangeReader.from_tensors(commit.model))
        self.load_state_dict(commit.optimizer)
        self.step_count = commit.step
        self.member.commit = commit
        self.member.loaded_step = None
        if self.lr_scheduler is not None and commit.lr_scheduler is not None:
            self._load_scheduler(commit.lr_scheduler)
        self._scaler.load(commit.grad_scaler)

    def state_dict(self) -> dict[str, Any]:
        """The strategy's sharded state plus ``step_count`` and the states of the owned scheduler
        and the GradScaler (JSON, the same on every rank), so a checkpoint resumes both."""
        return {**super().state_dict(), "step_count": self.step_count,
                "lr_scheduler": self._scheduler_state(), "grad_scaler": self._scaler.state(self)}

    def load_state_dict(self, state: dict[str, Any], reader: RangeReader | None = None) -> None:
        """Loads as the strategy's optimizer does, plus ``step_count`` and the states of the
        scheduler and the GradScaler (where saved and registered); the next ``step()`` commits
        what was loaded (``commit()`` commits it at once)."""
        super().load_state_dict(state, reader)
        if state.get("step_count") is not None:
            self.step_count = int(state["step_count"])
        saved = state.get("lr_scheduler")
        if saved is not None and self.lr_scheduler is not None:
            self._load_scheduler(saved)
        elif saved is not None:  # restoring in the constructor: the scheduler is built after
            self._loaded_scheduler = saved
        self._scaler.load(state.get("grad_scaler"))
        # Until committed, a failure would roll the survivors back to before this load. The
        # restore's own loads (a commit, a checkpoint) clear it as they commit.
        self.member.loaded_step = self.step_count

    def _scheduler_state(self) -> dict[str, Any] | None:
        return None if self.lr_scheduler is None else scheduler_state(self.lr_scheduler, "ElasticOptimizer")

    def _load_scheduler(self, state: dict[str, Any]) -> None:
        """The scheduler's committed state, and the rates it had set (a scheduler built afresh sets
        those of its first step, and load_state_dict leaves the optimizer's rates alone)."""
        self.lr_scheduler.load_state_dict(state)
        for group, lr in zip(self.param_groups, self.lr_scheduler.get_last_lr()):
            group["lr"] = lr


def _refuse_model_parallel(model: Any) -> None:
    """ConfigError for any model but the data-parallel ones (_DATA_PARALLEL_MODELS)."""
    if isinstance(model, _DATA_PARALLEL_MODELS):
        return
    names = ", ".join(cls.__name__ for cls in _DATA_PARALLEL_MODELS)
    fix = getattr(model, "optimizer_name", "that model's own optimizer")
    raise ConfigError(f"ElasticOptimizer supports only data-parallel models ({names}), got "
                      f"{type(model).__name__}, whose ranks share batch slices that elastic training "
                      f"splits by rank; wrap the module in one of those, or train this model with {fix}")


def _or_minus_one(step: int | None) -> int:
    return -1 if step is None else step


def _slice_batch(batch: Any, rank: int, world_size: int) -> Any:
    """Part ``rank`` of ``world_size`` equal parts (dim 0) of every tensor in ``batch``."""
    if isinstance(batch, dict):
        return {k: _slice_batch(v, rank, world_size) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        parts = [_slice_batch(v, rank, world_size) for v in batch]
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    if not isinstance(batch, torch.Tensor) or batch.dim() == 0:
        return batch
    if batch.shape[0] % world_size:
        raise ConfigError(f"global batch of {batch.shape[0]} does not split evenly over "
                          f"{world_size} ranks; use a multiple of every world size")
    n = batch.shape[0] // world_size
    return batch[rank * n:(rank + 1) * n]
