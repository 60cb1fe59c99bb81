"""The parameter server's wire protocol over a backend's send/recv (no collectives).

Every message is a 4-integer header on ``HEADER_TAG``, followed for some kinds by a body:

worker -> server   PUSH    [PUSH, clock, pulled_version, partial]  + flat gradient on BODY_TAG,
                           then, when partial is 1, which parameters got a gradient (one
                           uint8 each) on BODY_TAG: the server leaves the others' .grad None
                   DONE    [DONE, clock, 0, 0]               (the worker has finished)
                   FAILED  [FAILED, clock, 0, 0]             + the error text on TEXT_TAG
server -> worker   PARAMS  [PARAMS, version, 0, 0]           + flat parameters on BODY_TAG
                   STOP    [STOP, version, 0, 0]             (stop training; nothing follows)

Messages between one pair of ranks arrive in order per tag, so a header and its body pair up.
Also here: flattening parameters and gradients into the one vector that travels.
"""
from __future__ import annotations

import enum

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import Work
from distframe.errors import ConfigError

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
