"""``distframe train --optimizer elastic``: the demo in which workers leave, join and fail while
the job trains (in-memory engine only: workers are threads that an ``ElasticController`` starts
in successive groups).

The run starts with ``--world-size`` workers (``--resume``: the world the schedule had reached).
``--elastic-schedule "STEP:WORLD,..."`` changes the world cleanly after STEP steps (every worker
commits, workers beyond WORLD leave, new ones join and receive the commit); ``--fail-at STEP``
makes the group's last worker raise after STEP steps (once): the survivors roll back to their
newest commit (``--commit-every``) and go on one fewer. Each group runs the ordinary ``Job``
loop from the step its ElasticOptimizer restored, so the metrics, validation, checkpoints and
plot are the same as under ``--optimizer none``; steps redone after a rollback replace the
records written before the failure. A group that could restore only an older state than the
run's newest commit (every worker that held it failed) stops the run with one line on stderr
(ElasticRollbackError, exit status 1). Rank 0 of each group prints one line per membership change
on stderr.

Dropout masks: a group that restores a checkpoint continues the generator states it holds (the
same layout) or starts new streams seeded from the step, as ``Job`` does; a group that restores a
commit (a membership change, a rollback) starts new streams seeded from the commit's step, and
rank 0 prints the same note (see ``train_rng``).
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from attention.model import DilatedTransformerLM
from distframe import train_checkpoint, train_rng
from distframe.data import TokenCorpus
from distframe.errors import CollectiveTimeoutError, ConfigError, RankFailedError
from distframe.optimizers.elastic_demo import DemoWorkerFailure
from distframe.optimizers.elastic_membership import ElasticController
from distframe.train_config import TrainConfig, timeout_of
from distframe.train_loop import (DTYPES, Job, TrainResult, build_model_and_optimizer,
                                  initial_model_state, prepare_out, run_info)
from distframe.train_metrics import MetricsLog


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_elastic(config: TrainConfig, corpus: TokenCorpus,
                log: Callable[[str], None] = _stderr, start_notes: Sequence[str] = ()) -> TrainResult:
    """Runs the elastic demo in this process and returns the last group's rank-0 result;
    ``start_notes`` as ``train_on_rank``'s."""
    info = run_info(config, corpus, config.world_size, "inmemory")
    start_step = _prepare_out(config, info, start_notes)
    initial_state = initial_model_state(config, corpus.vocab_size)
    failed: set[int] = set()  # steps at which the injected failure already happened
    fatal: list[BaseException] = []  # a real error: stop instead of dropping the worker

    def worker(backend: Any, member: Any) -> TrainResult:
        if fatal:
            raise RankFailedError(None, "stopping after an error on another worker")
        try:
            module = DilatedTransformerLM(config.model_config(vocab_size=corpus.vocab_size))
            module.load_state_dict(initial_state)
            module.to(dtype=DTYPES[config.dtype])
            return _group_job(module, backend, member, config, corpus, info, failed, log).run()
        except (DemoWorkerFailure, RankFailedError, CollectiveTimeoutError):
            raise  # the controller drops the worker that failed, or that its peers waited for
        except BaseException as exc:
            fatal.append(exc)
            raise

    schedule = config.elastic_schedule_steps()
    # A resumed run starts with the world the schedule had reached, as the uninterrupted run had.
    controller = ElasticController(worker, initial_world=config.elastic_world_at(start_step),
                                   schedule=schedule,
                                   start_step=start_step, **timeout_of(config))
    try:
        generations = controller.run()
    except BaseException:
        if fatal:
            raise fatal[0] from None
        raise
    if fatal:
        raise fatal[0]
    for g in generations:
        how = f"worker {g.failed_worker} failed ({g.error})" if g.end == "failed" else g.end
        log(f"elastic: workers {g.members} from step {g.start_step}: {how}")
    log(f"elastic: finished step {config.steps} with world size {len(generations[-1].members)}")
    return generations[-1].results[0]


def _group_job(module: torch.nn.Module, backend: Any, member: Any, config: TrainConfig,
               corpus: TokenCorpus, info: dict, failed: set[int],
               log: Callable[[str], None]) -> ElasticJob:
    """This worker's model, ElasticOptimizer (which restores the group's state) and job, for the
    group of ``backend``; collective. Rank 0 logs where the group starts from."""
    saved = _CheckpointStates(config, backend)
    model, optimizer = build_model_and_optimizer(
        module, backend, config, member=member, read_rank_state=saved.read,
        checkpoint_dir=train_checkpoint.checkpoint_dir(config.out))
    members = backend.all_gather(torch.tensor([member.worker_id], dtype=torch.int64))
    if backend.rank == 0:
        log(f"elastic: world {backend.world_size} (workers {members.tolist()}) from step "
            f"{optimizer.step_count}, restored from {optimizer.restored_from}")
    return ElasticJob(backend, config, model, optimizer, corpus, torch.device("cpu"),
                      backend.world_size, backend.rank, info, failed=failed,
                      checkpoint_states=saved, log=log)


def _prepare_out(config: TrainConfig, info: dict, notes: Sequence[str]) -> int:
    """What ``Job._start`` does for one world, once for the whole elastic run: check that
    ``--resume`` has a checkpoint (the ElasticOptimizer restores it), or clear an earlier run.
    Returns the step the run starts from."""
    log = MetricsLog(config.out)
    found = train_checkpoint.latest_checkpoint(config.out)
    if config.resume and found is None:
        raise ConfigError(f"--resume: no checkpoint under {config.out}/checkpoints; run without "
                          "--resume to start fresh, or pass the --out of the run to continue")
    prepare_out(config, info, log, notes)
    return found[1] if config.resume and found is not None else 0


class _CheckpointStates:
    """This worker's generator states in the checkpoint its ElasticOptimizer restores, if it
    restores one: read (``read``, checkpoint.load's ``read_rank_state``) while the optimizer is
    built, before the job and its RankRandomState exist. ``saved`` stays None otherwise."""

    def __init__(self, config: TrainConfig, backend: Any) -> None:
        self.layout, self.rank = train_rng.layout(config, backend.world_size), backend.rank
        self.saved: train_rng.SavedStates | None = None

    def read(self, meta: dict[str, Any], reader: Any) -> None:
        self.saved = train_rng.read_saved(meta, reader, self.layout, self.rank)


class ElasticJob(Job):
    """``Job`` for one group of elastic workers: starts at the step its optimizer restored (and
    the dropout streams there), stops where the membership changes, and injects the
    ``--fail-at`` failure. ``log`` prints rank 0's notes."""

    def __init__(self, *args: Any, failed: set[int], checkpoint_states: _CheckpointStates,
                 log: Callable[[str], None] = _stderr, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failed, self.checkpoint_states, self.log_line = failed, checkpoint_states, log

    def _start(self) -> tuple[int, list[dict]]:
        step = self.optimizer.step_count
        note = self._continue_masks(step)
        if note and self.is_writer:
            self.log_line(note)
        if self.is_writer:  # drops records of steps redone after a rollback
            history = self.log.keep_until(step)
        else:
            history = [r for r in self.log.records() if r["step"] <= step]
        self.backend.barrier()
        return step, history

    def _continue_masks(self, step: int) -> str | None:
        """Sets this rank's dropout streams for the steps after ``step``; returns the note for
        masks that do not continue exactly, or None."""
        if self.checkpoint_states.saved is not None:  # the optimizer restored a checkpoint
            self.rng.take(self.checkpoint_states.saved)
            return self.rng.continue_from(step)
        if step == 0:  # the initial state: the ranks' initial streams, as a fresh run draws
            return None
        # A commit holds no generator states (they are a rank's, and the group is another):
        # the ranks' initial streams would draw again the masks of steps 1, 2, ...
        before = self.optimizer.member.commit.world_size
        return self.rng.new_streams(step, f"the workers changed at step {step} (world size {before} "
                                          f"-> {self.backend.world_size}); a commit holds no generator "
                                          "states, and a rank's streams have no counterpart in another group")

    def _stop_before(self, step: int) -> bool:  # noqa: ARG002
        return self.optimizer.membership_changes

    def _train_step(self, step: int) -> tuple[float, float]:
        fail_at = self.config.fail_at
        if step - 1 == fail_at and self.backend.rank == self.backend.world_size - 1:
            if fail_at not in self.failed:  # one thread checks: the group's last rank
                self.failed.add(fail_at)
                raise DemoWorkerFailure(f"worker {self.optimizer.member.worker_id} fails after "
                                        f"step {fail_at} (--fail-at)")
        return super()._train_step(step)
