"""The serving rank's loop of asynchronous SGD: apply pushed gradients, hand out parameters,
bound staleness, and survive workers that die.

[Note: the staleness gate] A gradient's staleness is the number of updates the server applied
between the worker's pull and the application of its gradient. The server guarantees it never
exceeds ``max_staleness`` (s) without ever dropping a gradient, by deciding when a worker may
start a step (receive parameters): with P the workers computing on parameters they pulled
(pending), a worker may start at version V only if

    (V - oldest pulled version in P and the starter) + |P| <= s.

Every application before a pending gradient's own adds one to its age and removes one from the
number of gradients that can still land before it, so age + others stays <= s; it is the
worker that would push the oldest gradient further than s that waits ("a worker further ahead
waits"). s = 0 is sequential SGD. With W workers taking turns, a worker restarts while the W - 1
others pend, the oldest of them pulled W - 1 updates ago: (W - 1) + (W - 1), so s >= 2 (W - 1)
never throttles them (s = W - 1 makes each wait for the push of the one before it).

[Note: a worker dropped while still computing] A worker that sends nothing for the
worker_timeout is declared dead; it may only be slow. Its staleness was accounted for up to the
drop only (it left the gate then), so a gradient it pushes later must not be applied. The server
tells it at once (a DROPPED header and why: small messages, which every engine delivers without
waiting for the receiver), and while it serves on it keeps the worker's header receive posted:
a late push is received and discarded (``AsyncReport.discarded_gradients``; so a large one never
waits for a receiver that never comes), a late DONE or FAILED is noted. The worker looks for the
notice before it pushes, and gets it at the latest as the answer to its push or finish()
(``WorkerDroppedError``, naming the timeout to raise). The server does not wait for it: serve()
ends when the others are done, as for any failed worker.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any

import torch

from distframe.backends.departures import receive_departure_error
from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import Work
from distframe.errors import CollectiveTimeoutError
from distframe.optimizers.async_protocol import (
    BODY_TAG,
    HEADER_TAG,
    FlatParameters,
    Kind,
    ModelBuffers,
    post_header,
    recv_text,
    send_header,
    send_text,
)

#: How often a server with nothing to serve asks whether an awaited worker has left the group.
DEPARTURE_POLL_S = 0.2


@dataclasses.dataclass
class AsyncReport:
    """What ``serve()`` returns: updates applied (in total and per worker), the staleness of
    the applied gradients, workers that failed or went silent (rank -> reason), and whether the
    server told the others to stop. ``discarded_gradients``: gradients that workers dropped at
    the worker_timeout pushed afterwards (rank -> count); they were received, never applied."""

    updates: int = 0
    updates_per_worker: dict[int, int] = dataclasses.field(default_factory=dict)
    max_staleness_seen: int = 0
    staleness_sum: int = 0
    failed_workers: dict[int, str] = dataclasses.field(default_factory=dict)
    stopped: bool = False
    wall_s: float = 0.0
    discarded_gradients: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def mean_staleness(self) -> float:
        return self.staleness_sum / self.updates if self.updates else 0.0


class ParameterServer:
    """Runs on the serving rank; ``flat`` are the server's parameters, ``optimizer`` updates them.

    ``deterministic``: serve pushes in a fixed round-robin order of the computing workers
    (blocking receives), so a run equals a sequential replay; otherwise the first header to
    arrive is served. ``on_worker_failure``: "continue" (drop the worker) or "stop"
    (tell every other worker to stop). ``worker_timeout``: seconds without a message from a
    computing worker before it is declared dead (``timeout_hint`` tells such a worker how to
    raise it). ``buffers``: the server's model buffers, which pushes update and pulls carry.
    ``lr_scheduler``: the server's scheduler (on ``optimizer``), stepped once per applied update.
    """

    def __init__(self, backend: ICommunicationBackend, flat: FlatParameters, buffers: ModelBuffers,
                 optimizer: torch.optim.Optimizer, workers: list[int], *, max_staleness: int,
                 staleness_lr: bool, deterministic: bool, on_worker_failure: str,
                 worker_timeout: float, timeout_hint: str, lr_scheduler: Any = None) -> None:
        self.backend, self.flat, self.buffers, self.optimizer = backend, flat, buffers, optimizer
        self.timeout_hint = timeout_hint
        self.max_staleness = max_staleness
        self.staleness_lr = staleness_lr
        self.deterministic = deterministic
        self.on_worker_failure = on_worker_failure
        self.worker_timeout = worker_timeout
        self.version = 0
        self.pulled: dict[int, int] = {}           # pending worker -> version it computes on
        self.waiting: list[int] = list(workers)    # workers waiting for parameters, in order
        self.clock = {w: 0 for w in workers}
        self.stopping = False
        self.report = AsyncReport(updates_per_worker={w: 0 for w in workers})
        self.lr_scheduler = lr_scheduler
        self._arrivals: queue.Queue = queue.Queue()
        self._listening: set[int] = set()
        # Header receives posted and not yet completed, kept across a wait that timed out: a
        # later wait completes the same receive (a new one would wait for the next message).
        self._posted: dict[int, tuple[torch.Tensor, Work]] = {}
        self._dropped_alive: set[int] = set()  # [Note: a worker dropped while still computing]
        self._headers = {w: 0 for w in workers}  # headers received from each worker
        self._rotation = list(workers)

    # ---- the loop ------------------------------------------------------------------------------
    def serve(self) -> AsyncReport:
        start = time.perf_counter()
        self._release_waiting()
        while self.pulled or self.waiting:
            message = self._next_message()
            if message is not None:
                self._handle(*message)
            self._release_waiting()
        self.report.wall_s = time.perf_counter() - start
        return self.report

    def _next_message(self) -> tuple[int, torch.Tensor] | None:
        """(worker, header) of the next message to serve; None when a worker was dropped."""
        if self.deterministic:
            candidates = [next(r for r in self._rotation if r in self.pulled)]
            self._rotation.remove(candidates[0])
            self._rotation.append(candidates[0])
        else:
            candidates = list(self.pulled)
        # [Note: waiting for any worker] The backends have no receive-from-any-source, and a
        # posted receive's is_completed() is only trustworthy on some engines (Gloo reports
        # completion when waited for), so each awaited worker's header is waited for on a
        # thread of its own, and the first to arrive is served. Between arrivals the server asks
        # the backend which workers have left the group (distframe.backends.departures).
        for w in candidates:
            if w not in self._listening:
                self._listen(w, self.worker_timeout)
        while True:
            try:
                w, header, error = self._arrivals.get(timeout=DEPARTURE_POLL_S)
            except queue.Empty:
                left = self._departed(candidates)
                if left is not None:
                    self._drop(*left)
                    return None
                continue
            self._listening.discard(w)
            if error is None:
                self._posted.pop(w, None)
            if w in self._dropped_alive:
                self._late_message(w, header, error)
            elif w in self.pulled:  # else a worker already dropped as departed
                break
        if isinstance(error, CollectiveTimeoutError):
            left = self._departed([w], received_all=True)
            if left is not None:
                self._drop(*left)
            else:
                self._drop_alive(w)
            return None
        if error is not None:
            raise error
        self._headers[w] += 1
        return w, header

    def _listen(self, worker: int, timeout: float | None) -> None:
        """Waits for ``worker``'s next header on a thread, for ``timeout`` seconds (None: the
        backend's timeout); the arrival, or the error, goes to ``_arrivals``."""
        if worker not in self._posted:
            self._posted[worker] = post_header(self.backend, worker)
        header, work = self._posted[worker]

        def wait() -> None:
            try:
                work.wait(timeout=timeout)
                self._arrivals.put((worker, header, None))
            except BaseException as exc:  # noqa: BLE001 - handed to the serving thread
                self._arrivals.put((worker, None, exc))
        self._listening.add(worker)
        threading.Thread(target=wait, name=f"distframe-ps-listen-{worker}", daemon=True).start()

    def _departed(self, workers: list[int], received_all: bool = False) -> tuple[int, str] | None:
        """(worker, reason) for one of ``workers`` that has left the group with no message to the
        server still on its way (so it can never send one), else None. A worker's function that
        returns without finish() leaves this way; so does one that raised outside train_step.
        ``received_all``: the worker's receive has failed, so nothing is on its way (for engines
        that do not say how many messages a rank sent before it left)."""
        # CommunicationBackendBase.departures; a backend that only follows the protocol cannot say.
        departures = getattr(self.backend, "departures", dict)()
        for w in workers:
            left = departures.get(w)
            # The receive rule of the engines: is header number _headers[w] + 1 never coming?
            never = left is not None and receive_departure_error(
                left, w, self.backend.rank, HEADER_TAG, self._headers[w] + 1, 0.0) is not None
            if left is not None and (received_all or never):
                how = "raised" if left.failed else "returned without calling finish()"
                return w, (f"its function {how} and it left the group while computing on "
                           f"parameters of version {self.pulled.get(w)}, with no gradient on its way")
        return None

    def _handle(self, worker: int, header: torch.Tensor) -> None:
        kind = Kind(int(header[0]))
        if kind is Kind.PUSH:
            grad, got, buffers = self._receive_push(worker, header)
            # Applied even when stopping: the gate admitted it, and its worker holds its loss.
            # The worker then waits for parameters; stopping, it gets the STOP instead.
            self._apply(worker, grad, got, self.version - self.pulled.pop(worker))
            self.buffers.take(buffers)  # the latest pushed (AsyncSGDOptimizer's docstring says why)
            self.waiting.append(worker)
        elif kind is Kind.DONE:
            self.pulled.pop(worker)
            send_header(self.backend, worker, Kind.STOP, self.version)  # finish() waits for it
        elif kind is Kind.FAILED:
            self._drop(worker, recv_text(self.backend, worker))
        else:
            raise RuntimeError(f"parameter server got message kind {kind.name} from worker {worker}")

    def _receive_push(self, worker: int, header: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """The body of a PUSH: (gradient, which parameters got one or None, buffers)."""
        grad = self.backend.recv(self.flat.empty(), worker, BODY_TAG)
        got = self.backend.recv(self.flat.empty_mask(), worker, BODY_TAG) if int(header[3]) else None
        return grad, got, [self.backend.recv(b, worker, BODY_TAG) for b in self.buffers.empty()]

    def _drop_alive(self, worker: int) -> None:
        """The worker_timeout passed with no word from a worker still in the group ([Note: a
        worker dropped while still computing])."""
        version = self.pulled.get(worker)
        self._drop(worker, f"sent nothing for {self.worker_timeout:g} s")
        send_header(self.backend, worker, Kind.DROPPED, self.version)
        send_text(self.backend, worker, (
            f"the parameter server (rank {self.backend.rank}) heard nothing from this worker (rank "
            f"{worker}) for {self.worker_timeout:g} s while it computed on parameters of version "
            f"{version}, declared it dead and takes nothing more from it: {self.timeout_hint}"))
        self._dropped_alive.add(worker)
        self._listen(worker, None)  # a late message may come within the backend's timeout

    def _late_message(self, worker: int, header: torch.Tensor | None, error: BaseException | None) -> None:
        """What a worker dropped at the worker_timeout sent afterwards: discarded, and noted."""
        self._dropped_alive.discard(worker)
        self._posted.pop(worker, None)
        if error is not None:
            return  # nothing came within the backend's timeout, or it left: nothing to drain
        kind = Kind(int(header[0]))
        if kind is Kind.PUSH:
            self._receive_push(worker, header)
            self.report.discarded_gradients[worker] = self.report.discarded_gradients.get(worker, 0) + 1
            self.report.failed_workers[worker] += "; the gradient it pushed afterwards was discarded"
        elif kind is Kind.FAILED:
            self.report.failed_workers[worker] += f"; afterwards it failed: {recv_text(self.backend, worker)}"
        # DONE: it finished after the drop; the DROPPED notice already answers it.

    def _apply(self, worker: int, grad: torch.Tensor, got: torch.Tensor | None, staleness: int) -> None:
        if staleness > self.max_staleness:  # the gate makes this impossible; say so if not
            raise RuntimeError(f"gradient of worker {worker} is {staleness} updates stale, over "
                               f"max_staleness={self.max_staleness}")
        self.flat.load_gradients(grad, got)
        # The rate of this update: the scheduler's (or the one set before serve()), not a rate
        # taken once when serving began, which no schedule could move.
        rates = [group["lr"] for group in self.optimizer.param_groups]
        for group, lr in zip(self.optimizer.param_groups, rates):
            group["lr"] = lr / (1 + staleness) if self.staleness_lr else lr
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, rates):
            group["lr"] = lr  # the scaled rate was this gradient's; the optimizer keeps its own
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()  # the next update's rate
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self.clock[worker] += 1
        report = self.report
        report.updates += 1
        report.updates_per_worker[worker] += 1
        report.staleness_sum += staleness
        report.max_staleness_seen = max(report.max_staleness_seen, staleness)

    # ---- who may start -------------------------------------------------------------------------
    def _may_start(self) -> bool:
        oldest = min(self.pulled.values(), default=self.version)
        return (self.version - oldest) + len(self.pulled) <= self.max_staleness

    def _release_waiting(self) -> None:
        if self.stopping:
            for w in self.waiting:
                send_header(self.backend, w, Kind.STOP, self.version)
            self.waiting = []
            return
        while self.waiting and self._may_start():
            w = self.waiting.pop(0)
            send_header(self.backend, w, Kind.PARAMS, self.version)
            self.backend.send(self.flat.values(), w, BODY_TAG)
            for vector in self.buffers.values():
                self.backend.send(vector, w, BODY_TAG)
            self.pulled[w] = self.version

    def _drop(self, worker: int, reason: str) -> None:
        """A worker failed or went silent: forget it; stop the others if so configured."""
        self.pulled.pop(worker, None)
        if worker in self.waiting:
            self.waiting.remove(worker)
        self.report.failed_workers[worker] = reason
        if self.on_worker_failure == "stop":
            self.stopping = True
            self.report.stopped = True
