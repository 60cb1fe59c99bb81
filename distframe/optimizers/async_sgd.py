"""AsyncSGDOptimizer: asynchronous SGD with a parameter server and bounded staleness.

One rank (``server_rank``, default 0) holds the authoritative parameters and the optimizer
state and runs ``serve()``; every other rank is a worker: it pulls parameters, computes a
gradient on its own data and pushes it, with no barrier between workers. Only point-to-point
send/recv is used (``async_protocol.py``), so it runs over any engine. The server loop and the
staleness gate are in ``async_server.py``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from distframe.backends.objects import broadcast_bytes
from distframe.errors import ConfigError
from distframe.models.base import ShardedModelBase
from distframe.models.ddp import DDPModel
from distframe.models.sharded_state import RangeReader
from distframe.optimizers.async_config import AsyncConfig, check_same_config
from distframe.optimizers.async_protocol import (
    BODY_TAG,
    HEADER_TAG,
    FlatParameters,
    Kind,
    ModelBuffers,
    WorkerDroppedError,
    recv_text,
    send_header,
    send_text,
)
from distframe.optimizers.async_schedule import ServerSchedule, refuse_unstepped_scheduler
from distframe.optimizers.async_server import AsyncReport, ParameterServer
from distframe.optimizers.async_state import decode_state, encode_state, replicate_settings
from distframe.optimizers.base import ShardedOptimizerBase
from distframe.optimizers.sharded_state import hyperparameters, optimizer_pieces

__all__ = ["AsyncConfig", "AsyncSGDOptimizer", "WorkerDroppedError"]


class AsyncSGDOptimizer(ShardedOptimizerBase):
    """Parameter-server asynchronous SGD on a ``DDPModel`` (whose gradient all_reduce it turns
    off: the model stays inside ``no_sync()``).

    Server (``is_server``): ``serve()`` loops until every worker is done, failed or stopped and
    returns an ``AsyncReport``; its model holds the trained parameters. Worker:
    ``train_step(batch, loss_fn)`` pulls parameters when it has none, runs forward and backward,
    then ``step()`` pushes the gradient and pulls the next parameters (waiting while the
    staleness gate holds it back); it returns this worker's local loss, and the server applies
    the gradient of every step that returned one, exactly once. When the server says stop,
    ``stopped`` becomes True. ``finish()`` tells the server this worker is done (and waits for
    its answer); a worker whose function returns without it is dropped (``failed_workers`` says
    so) once the engine reports its departure (``distframe.backends.departures``; Gloo and
    in-memory at once, MPI at the worker_timeout).
    A worker whose ``train_step`` raises reports the error to the server before re-raising.

    A worker that sends nothing for ``worker_timeout`` while it computes a step is declared dead,
    even if it is only slow: the server tells it so and takes nothing more from it, and its next
    ``train_step``, ``step()`` or ``finish()`` raises ``WorkerDroppedError``, naming the timeout
    to raise; the gradient it was computing is not applied (every earlier one was), whether it
    was still to send (it is not sent) or reached the server (received and discarded:
    ``AsyncReport.discarded_gradients``). The others continue or stop as ``on_worker_failure``
    says (``async_server.py``, [Note: a worker dropped while still computing]).

    Buffers (BatchNorm's running statistics; with the model's ``broadcast_buffers``, True by
    default, as torch DDP): a push carries the worker's buffers as they are after its step and
    a pull returns the server's, so every worker starts each step from the server's. Floating
    (and bool) buffers: the server takes the latest pushed, as DDP takes rank 0's. That keeps
    them values a real forward produced (a running variance stays positive; an average of stale
    pushes, or adding their differences as if they were gradients, can leave that range), makes
    the deterministic mode equal its sequential replay, and needs no state; what it costs, the
    statistics the other workers pushed since this worker's pull, matters little to a running
    average. Integer buffers are counters (``num_batches_tracked``): the server adds what each
    push's step added, so it counts every batch of every applied step. ``broadcast_buffers=False``
    keeps each rank's own, and nothing more travels; so does a model without buffers.

    Messages per worker step: a 32-byte header and the gradient (send), a header and the
    parameters (recv); with buffers, one vector per buffer dtype and one of int64 counters more
    each way. With ``find_unused_parameters=True`` (torch DDP's setting) a parameter
    that a worker's step gave no gradient has none on the server for that update (one more
    small message says which), so torch.optim skips it as a plain run does: no weight decay, no
    momentum, no step count; otherwise it is applied as zeros, as DDP averages it. Do not use
    ``model.train_step`` (it all-reduces the loss, a collective).

    Checkpoints: the server's parameters, buffers and optimizer state are the trained ones;
    workers hold the parameters they last pulled and no optimizer state. (On the server alone,
    read them from ``model.wrapped_model``: ``gather_full_parameters()`` broadcasts buffers, a
    collective, on a model that has some.) ``state_dict()`` on the server holds all of the
    optimizer state, on a worker none. Once ``serve()`` has returned and the workers have called
    ``finish()``, every rank calls ``synchronize_parameters()`` (broadcasts from the server of
    its parameters, buffers and param groups' settings), then ``distframe.checkpoint.save``; a
    worker's ``state_dict()`` refuses before that, as the checkpoint would hold part of its stale
    parameters (each rank writes a slice) and, from rank 0, its settings, not the server's.
    ``synchronize_optimizer_state()`` gives every rank the server's optimizer state too.

    Learning-rate schedule: the server's (``async_schedule.py``). ``lr_scheduler``: a function
    that builds a torch scheduler on a torch optimizer (``lambda opt: LambdaLR(opt, f)``), built
    on every rank's wrapped optimizer (or later, before training: ``set_lr_scheduler``); the
    server applies each update at its rate (scaled by ``1 / (1 + staleness)`` with
    ``staleness_lr``), then steps it. Its state is in the server's ``state_dict()`` (every
    rank's after ``synchronize_optimizer_state()``), so a checkpoint resumes it. A rate changed
    otherwise (a scheduler built on a worker's optimizer, a worker's lr set by hand) raises
    ConfigError at that worker's next push, as one built on the server's does at ``serve()``;
    so does, when built, a scheduler whose ``step()`` needs a metric (ReduceLROnPlateau).

    Construction (collective: one all_gather) refuses ranks built with different settings
    (optimizer, param groups, ``AsyncConfig``), naming them, on every rank alike.

    Loss scaling: workers step on their own, so each keeps a plain ``torch.amp.GradScaler`` (a
    step it skips pushes nothing); ``distframe.ShardedGradScaler``, a collective, is refused.
    """

    model_class = DDPModel
    steps_independently = True  # a worker's GradScaler skips (no push) or scales on its own

    def __init__(self, model: ShardedModelBase, optimizer: Any, *, config: AsyncConfig | None = None,
                 lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                 **settings: Any) -> None:
        fields = {f.name for f in dataclasses.fields(AsyncConfig)}
        config_settings = {k: settings.pop(k) for k in list(settings) if k in fields}
        if config is not None and config_settings:
            raise ConfigError(f"pass AsyncSGDOptimizer settings either as config= or as keywords, "
                              f"not both (got {sorted(config_settings)})")
        self.config = config or AsyncConfig(**config_settings)
        super().__init__(model, optimizer, **settings)
        backend = model.backend
        if backend.world_size < 2:
            raise ConfigError("AsyncSGDOptimizer needs a world of at least 2 ranks: one server and "
                              "one or more workers")
        if self.config.server_rank >= backend.world_size:
            raise ConfigError(f"AsyncSGDOptimizer server_rank={self.config.server_rank} is not a rank "
                              f"of this world of {backend.world_size}; use 0..{backend.world_size - 1}")
        check_same_config(backend, self.wrapped_optimizer, self.config)
        self._no_sync = model.no_sync()
        self._no_sync.__enter__()  # gradients stay local: the server, not an all_reduce, combines them
        self.flat = FlatParameters(list(model.local_parameter_shard()))
        self.buffers = ModelBuffers(model.wrapped_model, model.config.broadcast_buffers)
        self.workers = [r for r in range(backend.world_size) if r != self.config.server_rank]
        self.version = 0
        self.clock = 0
        self.stopped = False
        self._has_parameters = False
        self._finished = False
        # Whether this worker holds the server's parameters (see state_dict).
        self._parameters_replicated = True
        self._next_header: tuple[torch.Tensor, Any] | None = None  # the server's, posted by step()
        self._dropped: str | None = None  # why the server dropped this worker (WorkerDroppedError)
        self._schedule = ServerSchedule(self.param_groups)
        if lr_scheduler is not None:
            self.set_lr_scheduler(lr_scheduler)

    @property
    def lr_scheduler(self) -> Any:
        """This rank's copy of the server's lr scheduler (the server's steps), or None."""
        return self._schedule.scheduler

    def set_lr_scheduler(self, builder: Callable[[torch.optim.Optimizer], Any]) -> None:
        """Builds the server's lr scheduler, ``builder(self.wrapped_optimizer)``, on this rank
        (every rank calls it; see the class docstring), before training. It starts from its
        construction, on the groups' rates as they are: a scheduler state loaded before it
        existed is not applied (build it first, then load, to resume one)."""
        if self.clock or self.version or self._has_parameters:
            raise ConfigError("AsyncSGDOptimizer.set_lr_scheduler after training began: the server "
                              "has applied updates at the earlier rate; build it before training")
        self._schedule.build(builder, self.wrapped_optimizer)

    @property
    def is_server(self) -> bool:
        return self.model.backend.rank == self.config.server_rank

    # ---- server -------------------------------------------------------------------------------
    def serve(self) -> AsyncReport:
        """Runs the parameter server until every worker is done; returns the report."""
        if not self.is_server:
            raise ConfigError(f"serve() runs on the server rank {self.config.server_rank}; "
                              f"rank {self.model.backend.rank} is a worker: call train_step")
        backend = self.model.backend
        timeout = self.config.worker_timeout or getattr(backend, "timeout", 300.0)
        if self.config.worker_timeout is not None:
            hint = (f"raise AsyncSGDOptimizer's worker_timeout (now {timeout:g} s) above a worker's "
                    "longest step")
        else:
            hint = (f"worker_timeout is None, so the backend's timeout ({timeout:g} s) applies: pass "
                    "AsyncSGDOptimizer(worker_timeout=SECONDS) above a worker's longest step, or a "
                    "longer timeout= to the backend")
        refuse_unstepped_scheduler(self)
        server = ParameterServer(
            backend, self.flat, self.buffers, self.wrapped_optimizer, self.workers,
            lr_scheduler=self.lr_scheduler,
            max_staleness=self.config.max_staleness, staleness_lr=self.config.staleness_lr,
            deterministic=self.config.deterministic, on_worker_failure=self.config.on_worker_failure,
            worker_timeout=float(timeout), timeout_hint=hint)
        self._stepping = True  # the server steps the wrapped optimizer (adopt_instance in base.py)
        try:
            report = server.serve()
        finally:
            self._stepping = False
        self.version = server.version
        return report

    # ---- worker -------------------------------------------------------------------------------
    def train_step(self, batch: tuple[Any, Any], loss_fn: Callable[[Any, Any], torch.Tensor]) -> float:
        """Pull (if needed), forward, backward, push and pull; returns the local loss (nan when the
        server had already stopped this worker)."""
        self._require_worker("train_step")
        self._require_not_finished("train_step")
        try:
            if not self._has_parameters:
                self.pull()
            if self.stopped:
                return float("nan")
            loss = self.model.forward_backward(batch, loss_fn)
            self.step()
            return float(loss.detach())
        except Exception as exc:
            try:
                self.report_failure(exc)
            except Exception as report_error:  # noqa: BLE001 - the original error matters more
                exc.add_note(f"(reporting it to the server failed too: {report_error})")
            raise

    def step(self, closure: Any = None) -> None:
        """Pushes this worker's gradient, clears it and pulls fresh parameters."""
        self._require_worker("step")
        if closure is not None:
            raise ConfigError("AsyncSGDOptimizer.step takes no closure")
        self._require_not_finished("step")
        if not self._has_parameters:
            raise ConfigError("AsyncSGDOptimizer: pull() parameters before the first forward "
                              "(train_step does it for you)")
        if self.stopped:
            return
        self._schedule.before_push(self)  # before sending: the failure report is the next message
        backend, server = self.model.backend, self.config.server_rank
        # The answer's receive, posted now: a DROPPED notice already there means the server
        # declared this worker dead while it computed, and would discard this gradient.
        header, work = self._post_next_header()
        if work.is_completed() and int(header[0]) == Kind.DROPPED:
            self._receive_header("this step's gradient was not sent: it would not have been applied")
        got = self._got_gradients()  # None: every parameter has one
        send_header(backend, server, Kind.PUSH, self.clock, self.version, int(got is not None))
        backend.send(self.flat.gradients(), server, BODY_TAG)
        if got is not None:
            backend.send(got, server, BODY_TAG)
        for vector in self.buffers.pushed():
            backend.send(vector, server, BODY_TAG)
        self.clock += 1
        self.zero_grad()
        self._has_parameters = False
        self.pull()

    def _got_gradients(self) -> torch.Tensor | None:
        """With ``find_unused_parameters``, which parameters got a gradient since the last step
        (one uint8 each, in ``flat`` order); None when all did or the setting is off."""
        if not self.model.config.find_unused_parameters:
            return None
        usage = self.model.gradient_buckets.usage
        has = {id(p): flag for p, flag in zip(usage.params, usage.has_gradient)}
        got = torch.tensor([has[id(p)] for p in self.flat.params], dtype=torch.uint8)
        return None if bool(got.all()) else got

    def pull(self) -> None:
        """Waits for the server's next parameters (or its stop; nothing to wait for after one).
        A no-op while this worker holds parameters it has not pushed a gradient for: the server
        sends the next ones only in answer to a push (``step()`` pulls them)."""
        self._require_worker("pull")
        if self.stopped or self._has_parameters:  # no message is on its way: waiting would hang
            return
        backend, server = self.model.backend, self.config.server_rank
        header = self._receive_header("the gradient it pushed after that was discarded, not applied")
        if int(header[0]) == Kind.STOP:
            self.stopped = True
            return
        backend.recv(values := self.flat.empty(), server, BODY_TAG)
        self.flat.load_values(values)
        self.buffers.load([backend.recv(b, server, BODY_TAG) for b in self.buffers.empty()])
        self.version = int(header[1])
        self._has_parameters = True
        self._parameters_replicated = False  # the server steps on without this worker seeing it

    def _post_next_header(self) -> tuple[torch.Tensor, Any]:
        """The receive of the server's next header, posted once (``pull`` waits for it)."""
        if self._next_header is None:
            header = torch.zeros(4, dtype=torch.int64)
            self._next_header = header, self.model.backend.irecv(header, self.config.server_rank, HEADER_TAG)
        return self._next_header

    def _receive_header(self, fate: str) -> torch.Tensor:
        """Waits for the server's next header; a DROPPED one raises WorkerDroppedError, saying
        why and ``fate``, what became of this worker's last gradient."""
        header, work = self._post_next_header()
        self._next_header = None
        work.wait()
        if int(header[0]) != Kind.DROPPED:
            return header
        reason = recv_text(self.model.backend, self.config.server_rank)
        self._finished = True  # the server has let go: report_failure and finish() send nothing
        self._dropped = f"AsyncSGDOptimizer: {reason} ({fate})"
        raise WorkerDroppedError(self._dropped)

    def finish(self) -> None:
        """Tells the server this worker is done and waits for its answer (a no-op after a stop or
        a second call); WorkerDroppedError if the server had declared it dead meanwhile."""
        self._require_worker("finish")
        if self._finished or self.stopped:
            return
        if not self._has_parameters:
            self.pull()
            if self.stopped:
                return
        send_header(self.model.backend, self.config.server_rank, Kind.DONE, self.clock)
        self._finished = True
        self._receive_header("every gradient it pushed before was applied")  # STOP, or DROPPED

    def report_failure(self, exc: BaseException) -> None:
        """Tells the server this worker failed (it then continues or stops the others)."""
        if self._finished or self.stopped or self.is_server:
            return
        backend, server = self.model.backend, self.config.server_rank
        send_header(backend, server, Kind.FAILED, self.clock)
        send_text(backend, server, f"{type(exc).__name__}: {exc}")
        self._finished = True

    # ---- replicas and checkpoints -----------------------------------------------------------------
    def synchronize_parameters(self) -> None:
        """Every rank gets the server's parameters and buffers (one broadcast, one more per
        buffer vector) and its param groups' settings (two small broadcasts: a checkpoint takes
        rank 0's, and the run's are the server's, whose rate may have been set by hand);
        collective, after training."""
        self._require_session_over("synchronize_parameters")
        backend, server = self.model.backend, self.config.server_rank
        values = self.flat.values() if self.is_server else self.flat.empty()
        backend.broadcast(values, server)
        self.flat.load_values(values)
        buffers = self.buffers.values() if self.is_server else self.buffers.empty()
        for vector in buffers:
            backend.broadcast(vector, server)
        self.buffers.load(buffers)
        if not replicate_settings(backend, self.wrapped_optimizer, server):
            self._schedule.settings_loaded(self.param_groups)
        self._parameters_replicated = True

    def synchronize_optimizer_state(self) -> None:
        """Every rank gets the server's optimizer state, hyperparameters and lr scheduler state
        (two broadcasts); collective, after training."""
        self._require_session_over("synchronize_optimizer_state")
        layout, optimizer = self.model.shard_layout(), self.wrapped_optimizer
        blob = encode_state(layout, optimizer, self._schedule.state()) if self.is_server else b""
        blob = broadcast_bytes(self.model.backend, blob, self.config.server_rank)
        if not self.is_server:
            self._schedule.load(decode_state(layout, optimizer, blob), self.param_groups)

    def state_dict(self) -> dict[str, Any]:
        """The server's: all of the optimizer state (it alone steps; the replicated layout would
        give it a 1/world_size slice); a worker's: only the hyperparameters."""
        # With the names of the parameters each group trains, so a load gives each group its own
        # settings whatever order the loading optimizer builds them in (see ShardedOptimizerBase).
        groups = hyperparameters(self.wrapped_optimizer, self._optimizer_layout(), self._group_names)
        schedule = self._schedule.saved(self.is_server)
        if self.is_server:
            tensors, scalars = optimizer_pieces(self.model.shard_layout(), self.wrapped_optimizer, 0, 1)
            return {"tensors": tensors, "scalars": scalars, "param_groups": groups, **schedule}
        if not self._parameters_replicated:
            raise ConfigError(
                "AsyncSGDOptimizer: this worker holds stale parameters (the server holds the trained "
                "ones); after serve() and the workers' finish(), call opt.synchronize_parameters() on "
                "every rank, then save")
        return {"tensors": {}, "scalars": {}, "param_groups": groups, **schedule}

    def load_state_dict(self, state: dict[str, Any], reader: RangeReader | None = None) -> None:
        """Loads as ShardedOptimizerBase does, plus the lr scheduler's state where saved and
        built (the loaded groups already hold the rates it had set)."""
        super().load_state_dict(state, reader)
        self._schedule.load(state.get("lr_scheduler"), self.param_groups)

    def _require_session_over(self, what: str) -> None:
        if not self.is_server and self._has_parameters and not (self._finished or self.stopped):
            raise ConfigError(f"AsyncSGDOptimizer.{what} is collective and the server is still serving "
                              "this worker: call finish() first (after serve() returned on the server)")

    def should_early_stop(self, local_flag: bool) -> bool:
        """No consensus collective here (workers never meet): this worker's flag, or a stop."""
        return bool(local_flag) or self.stopped

    def _require_not_finished(self, what: str) -> None:
        if self._dropped is not None:
            raise WorkerDroppedError(self._dropped)
        if self._finished:  # the server has let go of this worker: a push would never be applied
            raise ConfigError(f"AsyncSGDOptimizer.{what} after this worker called finish() or reported a "
                              "failure; the server takes no more of its gradients (train before finish())")

    def _require_worker(self, what: str) -> None:
        if self.is_server:
            raise ConfigError(f"{what} runs on workers; rank {self.config.server_rank} is the "
                              "server: call serve() there")
