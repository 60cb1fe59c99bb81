"""``distframe train --optimizer async``: rank 0 serves the parameters, the other ranks train.

The server runs ``AsyncSGDOptimizer.serve()`` until every worker is done; each worker trains its
share of the ``--steps`` updates (worker i of W takes updates i+1, i+1+W, ..., each on the whole
``--batch-size`` global batch of that update's step) and pushes one gradient per update. The
server applies them in turn, the k-th update of the run at ``learning_rate(config, k)``: the
same warm-up and cosine schedule as a synchronous run, by update (the server's ``lr_scheduler``,
stepped once per update it applies). Nothing collective can run while the server serves, so:

* metrics are collected after the run: every worker's losses are gathered to rank 0 and logged
  one record per update, in the order the workers reported them (with ``--round-robin``, the
  order the server applied them, so a run repeats exactly); ``tokens_per_s`` of a record
  is that worker's own rate (one batch over its step time) and the result's tokens/s is the
  whole run's (every worker's tokens over the server's wall time);
* validation (``val_loss`` of the last record) and the checkpoint happen once, at the end: the
  server's parameters, buffers and optimizer state are broadcast to every rank first, so the
  checkpoint is an ordinary DDP one (``--resume`` under any strategy reads it). A
  ``--checkpoint-every`` interval is refused and ``--eval-every`` warned about when given
  (``train_settings.check_given_settings``).
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from distframe import train_checkpoint
from distframe.data import TokenCorpus
from distframe.errors import DistFrameError
from distframe.train_config import TrainConfig
from distframe.train_loop import Job, TrainResult, learning_rate, next_token_loss
from distframe.train_metrics import ProgressBar, peak_memory_bytes

SERVER_RANK = 0


class AsyncJob(Job):
    """One rank's part of an asynchronous run: ``run`` serves on rank 0 and trains elsewhere."""

    def __init__(self, backend: Any, config: TrainConfig, model: Any, optimizer: Any,
                 corpus: TokenCorpus, device: torch.device, info: dict, *,
                 start_notes: Sequence[str] = ()) -> None:
        super().__init__(backend, config, model, optimizer, corpus, device, 1, 0, info,
                         start_notes=start_notes)

    def run(self) -> TrainResult:
        start_step, history = self._start()
        wall_before = history[-1]["wall_s"] if history else 0.0
        self._schedule_the_server(start_step)
        self.backend.barrier()
        started = time.time()
        if self.backend.rank == SERVER_RANK:
            report = self.optimizer.serve()
            reports = torch.empty(0, 4, dtype=torch.float64)
        else:
            report, reports = None, self._work(start_step)
        serve_seconds = time.time() - started
        records = self._gather(reports)  # (updates, 4): update, loss, step seconds, time
        self._share_server_state()
        val_loss = self._server_validate()
        last = None
        if self.is_writer:
            last = self._log(records, start_step, started, wall_before, val_loss)
            self.notes.append(f"async: {report.updates} updates, mean staleness "
                              f"{report.mean_staleness:.2f} (max {report.max_staleness_seen})"
                              + (f", failed workers {report.failed_workers}"
                                 if report.failed_workers else ""))
        step = start_step + records.shape[0]
        checkpoint = train_checkpoint.save(self.config.out, step, self.model, self.optimizer,
                                           self.rng, self.info)
        self._finish()
        tokens = records.shape[0] * self.tokens_per_step
        return self._result(last, val_loss, tokens, serve_seconds, checkpoint)

    def _schedule_the_server(self, start_step: int) -> None:
        """Gives the server the run's schedule (every rank builds it; the server steps it once
        per applied update): the k-th update of the run (after ``start_step``) at
        ``learning_rate(config, k)``. Positioned by ``start_step``, the updates already done,
        whatever the resumed checkpoint holds (a synchronous run saves no scheduler)."""
        config = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = config.lr  # the schedule's base: --lr, not the rate the checkpoint saved
            group.pop("initial_lr", None)  # a resumed run's, which a new scheduler would take up

        def factor(updates_applied: int) -> float:
            return learning_rate(config, start_step + updates_applied + 1) / config.lr
        self.optimizer.set_lr_scheduler(lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor))

    def _work(self, start_step: int) -> torch.Tensor:
        """This worker's updates; returns one row (update, loss, seconds, time reported) per
        update, ``update`` being the step whose batch it trained on."""
        workers = self.backend.world_size - 1
        index = self.backend.rank - 1 if self.backend.rank > SERVER_RANK else self.backend.rank
        updates = range(start_step + 1 + index, self.config.steps + 1, workers)
        # The first worker's bar stands for the run: the workers take the updates in turn, so
        # each of its own is about ``workers`` of the run's.
        bar = ProgressBar(total=self.config.steps, initial=start_step, enabled=index == 0)
        rows = []
        try:
            for step in updates:
                inputs, targets = self.train_data.slice(step, 0, 1)
                began = time.perf_counter()
                loss = self.optimizer.train_step((inputs.to(self.device), targets.to(self.device)),
                                                 next_token_loss)
                if self.optimizer.stopped:
                    break
                seconds = time.perf_counter() - began
                if not math.isfinite(loss):
                    raise DistFrameError(f"the training loss became {loss} at update {step}; "
                                         f"lower --lr (now {self.config.lr:g})")
                rows.append((step, loss, seconds, time.time()))
                bar.update({"train_loss": loss, "val_loss": None, "peak_memory_bytes":
                            peak_memory_bytes(self.device),
                            "tokens_per_s": self.tokens_per_step / seconds}, steps=workers)
            self.optimizer.finish()
        finally:
            bar.close()
        return torch.tensor(rows, dtype=torch.float64).reshape(-1, 4)

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's rows, on every rank (padded all_gather), in the order the server applied
        them: by update with ``--round-robin`` (the server takes the workers in turn), else by
        the time the workers reported them."""
        counts = self.backend.all_gather(torch.tensor([rows.shape[0]], dtype=torch.int64))
        padded = torch.zeros(int(counts.max()), 4, dtype=torch.float64)
        padded[:rows.shape[0]] = rows
        gathered = self.backend.all_gather(padded).view(self.backend.world_size, -1, 4)
        merged = torch.cat([gathered[r, :int(counts[r])] for r in range(self.backend.world_size)])
        return merged[merged[:, 0 if self.config.round_robin else 3].argsort(stable=True)]

    def _share_server_state(self) -> None:
        """The server's parameters, buffers and optimizer state onto every rank (broadcasts), so
        every rank holds the trained model for validation and the checkpoint."""
        self.optimizer.synchronize_parameters()
        self.optimizer.synchronize_optimizer_state()

    def _server_validate(self) -> float:
        """Mean validation loss of the server's model over every validation batch, computed on
        the server and broadcast."""
        mean = torch.zeros(1, dtype=torch.float64)
        if self.backend.rank == SERVER_RANK:
            self.model.eval()
            with torch.no_grad():
                losses = [float(self.strategy.validation_loss(
                    self.model, inputs.to(self.device), targets.to(self.device), next_token_loss))
                    for inputs, targets in (self.val_data.windows(o, 0, 1)
                                            for o in self.val_offsets)]
            self.model.train()
            mean[0] = sum(losses) / len(losses)
        self.backend.broadcast(mean, SERVER_RANK)
        return float(mean)

    def _log(self, records: torch.Tensor, start_step: int, started: float, wall_before: float,
             val_loss: float) -> dict | None:
        last = None
        for i, (_, loss, seconds, reported) in enumerate(records.tolist()):
            last = {"step": start_step + i + 1, "train_loss": loss,
                    "val_loss": val_loss if i == records.shape[0] - 1 else None,
                    "tokens_per_s": self.tokens_per_step / seconds,
                    "peak_memory_bytes": peak_memory_bytes(self.device),
                    "wall_s": wall_before + reported - started}
            self.log.append(last)
        return last
