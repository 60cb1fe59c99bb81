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
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from attention.model import DilatedTransformerLM
from distframe import train_checkpoint
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
            model, optimizer = build_model_and_optimizer(
                module, backend, config, member=member,
                checkpoint_dir=train_checkpoint.checkpoint_dir(config.out))
            members = backend.all_gather(torch.tensor([member.worker_id], dtype=torch.int64))
            if backend.rank == 0:
                log(f"elastic: world {backend.world_size} (workers {members.tolist()}) from step "
                    f"{optimizer.step_count}, restored from {optimizer.restored_from}")
            job = ElasticJob(backend, config, model, optimizer, corpus, torch.device("cpu"),
                             backend.world_size, backend.rank, info, failed=failed)
            return job.run()
        except (DemoWorkerFailure, RankFailedError, CollectiveTimeoutError):
            raise  # the controller drops the worker that failed, or that its peers waited for
        except BaseException as exc:
            fatal.append(exc)
            raise

    schedule = config.elastic_schedule_steps()
    # A resumed run starts with the world the schedule had reached (the last change at or
    # before the step it resumes from), as the uninterrupted run would have.
    world = next((w for s, w in sorted(schedule.items(), reverse=True) if s <= start_step),
                 config.world_size)
    controller = ElasticController(worker, initial_world=world, schedule=schedule,
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


class ElasticJob(Job):
    """``Job`` for one group of elastic workers: starts at the step its optimizer restored,
    stops where the membership changes, and injects the ``--fail-at`` failure."""

    def __init__(self, *args: Any, failed: set[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failed = failed

    def _start(self) -> tuple[int, list[dict]]:
        step = self.optimizer.step_count
        if self.is_writer:  # drops records of steps redone after a rollback
            history = self.log.keep_until(step)
        else:
            history = [r for r in self.log.records() if r["step"] <= step]
        self.backend.barrier()
        return step, history

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
