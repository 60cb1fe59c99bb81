"""Point-to-point traffic between neighbouring pipeline stages.

Activations go forward with tag 0 and their gradients backward with tag 1, in micro-batch order
on each link, so the backends' per-(peer, tag) FIFO order pairs every send with its receive.
The receiver of an activation does not know its shape: the first activation of each step is
preceded by a small int64 header (dtype code, rank, sizes); later micro-batches of the step share
it. Gradients need no header (they have the shape of the activation the receiver sent).
Sends are non-blocking (``isend``) and waited for at the end of the step.
"""
from __future__ import annotations

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import Work

ACTIVATION_TAG, GRADIENT_TAG, HEADER_TAG = 0, 1, 2
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.bool, torch.uint8, torch.int8, torch.int16]
_HEADER_LEN = 12


class StageLinks:
    """The pipeline group seen from one stage: receive from ``stage - 1``, send to ``stage + 1``."""

    def __init__(self, backend: ICommunicationBackend) -> None:
        self.backend = backend
        self.stage = backend.rank
        self._pending: list[tuple[Work, torch.Tensor]] = []
        self._incoming: tuple[tuple[int, ...], torch.dtype] | None = None
        self._header_sent = False

    def new_step(self) -> None:
        self._incoming, self._header_sent = None, False

    def send_activation(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        if not self._header_sent:
            self._isend(encode_header(tensor), self.stage + 1, HEADER_TAG)
            self._header_sent = True
        self._isend(tensor, self.stage + 1, ACTIVATION_TAG)

    def recv_activation(self) -> torch.Tensor:
        if self._incoming is None:
            header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
            self.backend.recv(header, self.stage - 1, HEADER_TAG)
            self._incoming = decode_header(header)
        shape, dtype = self._incoming
        return self.backend.recv(torch.empty(shape, dtype=dtype), self.stage - 1, ACTIVATION_TAG)

    def send_gradient(self, grad: torch.Tensor) -> None:
        self._isend(grad.detach().contiguous(), self.stage - 1, GRADIENT_TAG)

    def recv_gradient(self, like: torch.Tensor) -> torch.Tensor:
        return self.backend.recv(torch.empty_like(like, memory_format=torch.contiguous_format),
                                 self.stage + 1, GRADIENT_TAG)

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        # The tensor is kept until the send completes (engines may read it asynchronously).
        self._pending.append((self.backend.isend(tensor, dst, tag), tensor))


def encode_header(tensor: torch.Tensor | None) -> torch.Tensor:
    """Dtype code, rank and sizes of ``tensor`` as an int64 tensor (zeros for None)."""
    if tensor is None:
        return torch.zeros(_HEADER_LEN, dtype=torch.int64)
    if tensor.dim() > _HEADER_LEN - 2:
        raise ValueError(f"pipeline activations of rank > {_HEADER_LEN - 2} are not supported")
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[0] = _DTYPES.index(tensor.dtype)
    header[1] = tensor.dim()
    header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    values = header.tolist()
    return tuple(values[2:2 + values[1]]), _DTYPES[values[0]]
