"""The parameter server's wire protocol over a backend's send/recv (no collectives).

Every message is a 4-integer header on ``HEADER_TAG``, followed for some kinds by a body:

worker -> server   PUSH    [PUSH, clock, pulled_version, partial]  + flat gradient on BODY_TAG,
                           then, when partial is 1, which parameters got a gradient (one
                           uint8 each) on BODY_TAG: the server leaves the others' .grad None;
                           then the worker's buffers (``ModelBuffers``, increments for counters)
                   DONE    [DONE, clock, 0, 0]               (the worker has finished; answered
                                                             by STOP, or by DROPPED)
                   FAILED  [FAILED, clock, 0, 0]             + the error text on TEXT_TAG
server -> worker   PARAMS  [PARAMS, version, 0, 0]           + flat parameters on BODY_TAG, then
                                                             the server's buffers
                   STOP    [STOP, version, 0, 0]             (stop training; nothing follows)
                   DROPPED [DROPPED, version, 0, 0]          + why on TEXT_TAG: sent, unasked,
                           to a worker declared dead at the worker_timeout; the server takes
                           nothing more from it (a late push is received and discarded)

Messages between one pair of ranks arrive in order per tag, so a header and its body pair up.
Also here: flattening parameters, gradients and buffers into the vectors that travel.
"""
from __future__ import annotations

import enum

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import Work
from distframe.errors import ConfigError, DistFrameError

HEADER_TAG = 7001
BODY_TAG = 7002
TEXT_TAG = 7003
TEXT_BYTES = 512


class Kind(enum.IntEnum):
    PUSH = 1
    DONE = 2
    FAILED = 3
    PARAMS = 4
    STOP = 5
    DROPPED = 6


class WorkerDroppedError(DistFrameError, RuntimeError):
    """The parameter server declared this worker dead (it sent nothing for the worker_timeout
    while it computed a step) and takes nothing more from it; the message says what became of
    its last gradient and which timeout to raise."""


def send_header(backend: ICommunicationBackend, dst: int, kind: Kind, a: int = 0, b: int = 0,
                c: int = 0) -> None:
    backend.send(torch.tensor([int(kind), a, b, c], dtype=torch.int64), dst, HEADER_TAG)


def post_header(backend: ICommunicationBackend, src: int) -> tuple[torch.Tensor, Work]:
    """A posted receive of ``src``'s next header: (buffer, work). The server asks for departures
    itself and serves the other workers on: the engine must not break the group to stop it."""
    header = torch.zeros(4, dtype=torch.int64)
    work = backend.irecv(header, src, HEADER_TAG)
    work.stop_on_departure = False
    return header, work


def send_text(backend: ICommunicationBackend, dst: int, text: str) -> None:
    raw = text.encode(errors="replace")[:TEXT_BYTES]
    buf = torch.zeros(TEXT_BYTES, dtype=torch.uint8)
    buf[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    backend.send(buf, dst, TEXT_TAG)


def recv_text(backend: ICommunicationBackend, src: int) -> str:
    buf = backend.recv(torch.zeros(TEXT_BYTES, dtype=torch.uint8), src, TEXT_TAG)
    return bytes(buf.tolist()).rstrip(b"\0").decode(errors="replace")


class FlatParameters:
    """The parameters as one vector (in ``dtype``, their common dtype) and back."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        if not params:
            raise ConfigError("AsyncSGDOptimizer needs a model with at least one trainable parameter")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ConfigError(f"AsyncSGDOptimizer sends parameters as one vector; the model mixes "
                              f"{sorted(str(d) for d in dtypes)}: convert it to one dtype")
        self.params = params
        self.dtype, self.device = params[0].dtype, params[0].device
        self.numel = sum(p.numel() for p in params)

    def empty(self) -> torch.Tensor:
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def values(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def gradients(self) -> torch.Tensor:
        """The gradients (zeros where a parameter got none)."""
        return torch.cat([p.grad.detach().reshape(-1) if p.grad is not None
                          else torch.zeros(p.numel(), dtype=self.dtype, device=self.device)
                          for p in self.params])

    def empty_mask(self) -> torch.Tensor:
        """A receive buffer for which parameters got a gradient (one uint8 each)."""
        return torch.empty(len(self.params), dtype=torch.uint8)

    def load_values(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for p, part in zip(self.params, flat.split([p.numel() for p in self.params])):
                p.copy_(part.view_as(p))

    def load_gradients(self, flat: torch.Tensor, got: torch.Tensor | None = None) -> None:
        """Sets each parameter's ``.grad``; None where ``got`` says it had none (a torch optimizer
        skips it then, as it skips a parameter unused in a plain run: no weight decay, no step)."""
        for i, (p, part) in enumerate(zip(self.params, flat.split([p.numel() for p in self.params]))):
            p.grad = part.view_as(p).clone() if got is None or got[i] else None


class ModelBuffers:
    """A model's buffers as the vectors a push and a pull carry after the parameters: one flat
    vector per dtype (in order of first appearance) of the buffers that are replaced (floating,
    complex, bool: BatchNorm's running statistics), then one int64 vector of the integer ones,
    counters such as ``num_batches_tracked``, to which a push adds. No vectors at all when
    ``enabled`` is False or the model has no buffers. Listed on each use, not cached:
    ``module.to()`` replaces buffer tensors."""

    def __init__(self, module: torch.nn.Module, enabled: bool) -> None:
        self.module, self.enabled = module, enabled
        self._counters_pulled: torch.Tensor | None = None  # the counters as this worker last loaded

    def _groups(self) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        """(replaced buffers grouped by dtype, counters)."""
        replaced: dict[torch.dtype, list[torch.Tensor]] = {}
        counters = []
        for buffer in self.module.buffers() if self.enabled else ():
            if buffer.dtype.is_floating_point or buffer.dtype.is_complex or buffer.dtype == torch.bool:
                replaced.setdefault(buffer.dtype, []).append(buffer)
            else:
                counters.append(buffer)
        return list(replaced.values()), counters

    def values(self) -> list[torch.Tensor]:
        """The vectors a pull (or a broadcast) carries: every buffer's value."""
        replaced, counters = self._groups()
        return [_flat(g) for g in replaced] + ([_flat(counters, torch.int64)] if counters else [])

    def pushed(self) -> list[torch.Tensor]:
        """The vectors a push carries: the replaced buffers' values and how much each counter
        grew since this worker last loaded the server's."""
        replaced, counters = self._groups()
        grown = [_flat(counters, torch.int64) - self._counters_pulled] if counters else []
        return [_flat(g) for g in replaced] + grown

    def empty(self) -> list[torch.Tensor]:
        """Receive buffers for ``values()`` of another rank (sized from the buffers, not copies)."""
        replaced, counters = self._groups()
        sized = [(g, g[0].dtype) for g in replaced] + ([(counters, torch.int64)] if counters else [])
        return [torch.empty(sum(t.numel() for t in group), dtype=dtype, device=group[0].device)
                for group, dtype in sized]

    def load(self, vectors: list[torch.Tensor]) -> None:
        """Every buffer from ``values()`` of another rank (a worker's pull, a broadcast)."""
        replaced, counters = self._groups()
        for group, vector in zip(replaced + [counters], vectors):
            _unflatten(group, vector)
        if counters:
            self._counters_pulled = vectors[-1].clone()

    def take(self, vectors: list[torch.Tensor]) -> None:
        """The server's part of a push (``pushed()``): the replaced buffers become the worker's,
        the counters grow by the worker's increments."""
        replaced, counters = self._groups()
        for group, vector in zip(replaced, vectors):
            _unflatten(group, vector)
        if counters:
            _unflatten(counters, _flat(counters, torch.int64) + vectors[-1])


def _flat(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(dtype or t.dtype) for t in tensors])


def _unflatten(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    with torch.no_grad():
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view_as(t))
