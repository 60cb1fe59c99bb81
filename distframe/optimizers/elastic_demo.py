"""The elastic demo behind ``distframe train --optimizer elastic``: train on in-memory workers
while workers leave, join and (optionally) fail, and log each change.

``run_elastic_demo`` is what the CLI calls; everything it does is public API
(``ElasticController``, ``ElasticOptimizer``), so it doubles as the worked example.
"""
from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from distframe.models.ddp import DDPModel
from distframe.optimizers.elastic import ElasticMember, ElasticOptimizer
from distframe.optimizers.elastic_membership import ElasticController, Generation


class DemoWorkerFailure(RuntimeError):
    """The failure the demo injects into one worker."""


def run_elastic_demo(model_fn: Callable[[], nn.Module], batch_fn: Callable[[int], tuple[Any, Any]],
                     loss_fn: Callable[[Any, Any], torch.Tensor], *, optimizer_cls: Any,
                     total_steps: int, initial_world: int = 2, schedule: dict[int, int] | None = None,
                     fail_worker: int | None = None, fail_at: int | None = None,
                     strategy: type = DDPModel, commit_every: int = 1,
                     log: Callable[[str], None] = print, **optimizer_kwargs: Any) -> list[Generation]:
    """Trains ``total_steps`` global steps of ``batch_fn(step)`` (a global batch divisible by
    every world size) with membership ``initial_world`` then ``schedule`` ({step: world size});
    worker ``fail_worker`` raises when it reaches step ``fail_at``. ``model_fn()`` must build
    the same model every call. Logs one line per step on rank 0 and per membership change."""
    template = model_fn()
    lock = threading.Lock()
    failed = set()

    def worker(backend: Any, member: ElasticMember) -> float | None:
        with lock:  # threads share torch's generator; copies of one template are identical
            module = copy.deepcopy(template)
        model = strategy(module, backend)
        opt = ElasticOptimizer(model, optimizer_cls, member=member, commit_every=commit_every,
                               **optimizer_kwargs)
        if backend.rank == 0:
            log(f"world {backend.world_size}: workers restored from {opt.restored_from}")
        loss = None
        while opt.step_count < total_steps and not opt.membership_changes:
            if member.worker_id == fail_worker and opt.step_count == fail_at and member.worker_id not in failed:
                failed.add(member.worker_id)
                raise DemoWorkerFailure(f"worker {member.worker_id} fails at step {fail_at}")
            step = opt.step_count
            loss = model.train_step(opt.local_slice(batch_fn(step)), loss_fn, opt)
            if backend.rank == 0:
                log(f"step {step + 1:4d}  world {backend.world_size}  loss {loss:.4f}")
        return loss

    generations = ElasticController(worker, initial_world=initial_world, schedule=schedule).run()
    for g in generations:
        how = f"worker {g.failed_worker} failed ({g.error})" if g.end == "failed" else g.end
        log(f"generation of workers {g.members} from step {g.start_step}: {how}")
    return generations

