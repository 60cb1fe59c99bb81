"""Point-to-point traffic between neighbouring pipeline stages.

A message is addressed to a global stage ``g`` (with interleaving, chunk c of rank r is global
stage ``c * p + r``): its activation travels with tag ``4g``, the gradient of stage g's output
with tag ``4g + 1``, the activation's header with tag ``4g + 2`` and the gradient's with ``4g + 3``.
On each tag messages go in micro-batch order, so the backends' per-(peer, tag) FIFO order pairs
every send with its receive. The receiver of an activation does not know its shape: the first
activation of each step for each stage is preceded by a small int64 header (dtype code, rank,
sizes); later micro-batches of the step share it, and one of another shape or dtype is a
ConfigError at its sender (the receives are posted with the header's). Gradients have the shape
of the activation the receiver sent; their header, one per step and stage, says whether a
gradient flows back at all (see [Note: inputs that get no gradient]). Sends are non-blocking
(``isend``) and waited for at the end of the step.

[Note: inputs that get no gradient]
A stage whose output does not depend on its input (it returns a parameter, or runs under
``no_grad``) leaves its input's ``.grad`` None. One process then leaves every parameter before it
without a gradient, and AdamW's weight decay and momentum leave those alone. Zeros sent back in
its place gave them zero gradients, which those steps do move. So the first gradient of each step
and stage is preceded by a one-element header: 0 when the input got no gradient, and the stage
before then runs no backward for that micro-batch (the zeros still travel: the receive was posted
ahead). A later micro-batch that gets none after one that got a gradient sends zeros, which is
exact (the parameters have a gradient anyway); the reverse is a ConfigError.

[Note: receives posted ahead] A receive is posted before the stage needs its data: the next
activation of a stage as soon as the previous one arrived (its shape is the step's header), and
the gradient of an output as soon as that output was sent. With Gloo a message moves only once
its receive is posted, so a receive posted at the moment of need cost a round trip per message
while the stage sat idle; posted ahead, the transfer overlaps the stage's compute. Each channel
(stage, kind) is FIFO in micro-batch order, which every schedule here keeps, and no more receives
are posted than the step has messages, so nothing is matched against the next step's traffic.

``broadcast_any`` sends a tensor whose shape the receivers do not know (the last stage's output of
a forward without autograd), or a tuple, list or dict of them, to every rank of a group, header
first.
"""
from __future__ import annotations

from collections import deque
from typing import Any

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import Work
from distframe.errors import ConfigError
from distframe.models.pipeline_outputs import flatten_output, unflatten_output

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.bool, torch.uint8, torch.int8, torch.int16, torch.complex64, torch.complex128]
_HEADER_LEN = 12
_STRUCTURE = -1  # a broadcast header's dtype code announcing a structure (broadcast_any)


class StageLinks:
    """Sends and receives of one pipeline rank, addressed by global stage."""

    def __init__(self, backend: ICommunicationBackend, *, device: torch.device | None = None) -> None:
        self.backend = backend
        self.device = torch.device("cpu") if device is None else device  # where activations land
        self._pending: list[tuple[Work, torch.Tensor]] = []
        self._incoming: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self._header_sent: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self._flows_sent: dict[int, bool] = {}  # stage: whether its first gradient flowed (header)
        self._flows: dict[int, bool] = {}  # stage: what the gradient header received said
        self._messages = 0  # per channel and step: the number of micro-batches
        self._activations_posted: dict[int, int] = {}
        self._posted: dict[tuple[str, int], deque[Work]] = {}

    def new_step(self, num_microbatches: int) -> None:
        if any(self._posted.values()):
            raise RuntimeError("a pipeline step ended with receives still posted; the schedule "
                               "received fewer messages than it was sent")
        self._incoming.clear()
        self._header_sent.clear()
        self._flows_sent.clear()
        self._flows.clear()
        self._activations_posted.clear()
        self._messages = num_microbatches

    def send_activation(self, tensor: torch.Tensor, dst: int, stage: int) -> None:
        """``tensor`` becomes global stage ``stage``'s input, on rank ``dst``."""
        tensor = tensor.detach().contiguous()
        sent = self._header_sent.get(stage)
        if sent is None:
            self._isend(encode_header(tensor), dst, 4 * stage + 2)
            self._header_sent[stage] = (tensor.shape, tensor.dtype)
        elif sent != (tensor.shape, tensor.dtype):
            raise ConfigError(
                f"pipeline stage {stage}'s input has shape {tuple(tensor.shape)} ({tensor.dtype}) in a later "
                f"micro-batch, but {tuple(sent[0])} ({sent[1]}) in the step's first: the activations "
                "passed between stages keep one shape and dtype across the micro-batches of a step. "
                "Pad every micro-batch to one length (trim per batch, not per micro-batch), or use "
                "num_microbatches=1")
        self._isend(tensor, dst, 4 * stage)

    def recv_activation(self, src: int, stage: int) -> torch.Tensor:
        """The next input of global stage ``stage`` (held here), from rank ``src``; the receive
        of the one after it is posted before returning (see [Note: receives posted ahead])."""
        if stage not in self._incoming:
            header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
            self.backend.recv(header, src, 4 * stage + 2)
            self._incoming[stage] = decode_header(header)
            self._post_activation(src, stage)
        received = self._posted[("activation", stage)].popleft().wait()
        self._post_activation(src, stage)
        return received

    def _post_activation(self, src: int, stage: int) -> None:
        posted = self._activations_posted.get(stage, 0)
        if posted < self._messages:
            shape, dtype = self._incoming[stage]
            self._channel("activation", stage).append(
                self.backend.irecv(torch.empty(shape, dtype=dtype, device=self.device), src, 4 * stage))
            self._activations_posted[stage] = posted + 1

    def send_gradient(self, grad: torch.Tensor | None, like: torch.Tensor, dst: int, stage: int) -> None:
        """The gradient of global stage ``stage``'s output (stage held by rank ``dst``): ``grad``,
        or None when the input ``like`` got none (see [Note: inputs that get no gradient])."""
        flows = grad is not None
        first = self._flows_sent.get(stage)
        if first is None:
            self._flows_sent[stage] = flows
            self._isend(torch.tensor([int(flows)], dtype=torch.int64), dst, 4 * stage + 3)
        elif flows and not first:
            raise ConfigError(
                f"pipeline stage {stage + 1}'s input got a gradient in a later micro-batch but none in the "
                "step's first: whether a stage's output depends on its input must not change between "
                "the micro-batches of a step")
        sent = grad if flows else torch.zeros_like(like)
        self._isend(sent.detach().contiguous(), dst, 4 * stage + 1)

    def expect_gradient(self, like: torch.Tensor, src: int, stage: int) -> None:
        """Posts the receive of the gradient of ``like``, the output of global stage ``stage``
        just sent to rank ``src``; ``recv_gradient`` returns it."""
        self._channel("gradient", stage).append(self.backend.irecv(
            torch.empty_like(like, memory_format=torch.contiguous_format), src, 4 * stage + 1))

    def recv_gradient(self, like: torch.Tensor, src: int, stage: int) -> torch.Tensor | None:
        """The gradient of the output ``like`` of global stage ``stage`` (held here): the oldest
        one posted by ``expect_gradient``, else received now; None when the next stage's input
        got no gradient this step (the zeros that stand in for it are received all the same)."""
        if stage not in self._flows:
            header = torch.zeros(1, dtype=torch.int64)
            self.backend.recv(header, src, 4 * stage + 3)
            self._flows[stage] = bool(header.item())
        posted = self._posted.get(("gradient", stage))
        if posted:
            grad = posted.popleft().wait()
        else:
            grad = self.backend.recv(torch.empty_like(like, memory_format=torch.contiguous_format),
                                     src, 4 * stage + 1)
        return grad if self._flows[stage] else None

    def _channel(self, kind: str, stage: int) -> deque[Work]:
        return self._posted.setdefault((kind, stage), deque())

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        # The tensor is kept until the send completes (engines may read it asynchronously), and
        # no longer: kept to the end of the step, every micro-batch's activation and input
        # gradient would be, not the few in flight the schedule promises. A completed send is
        # waited for to raise its error, if any.
        self._pending = [(work, t) for work, t in self._pending if not _finished(work)]
        self._pending.append((self.backend.isend(tensor, dst, tag), tensor))


def _finished(work: Work) -> bool:
    if not work.is_completed():
        return False
    work.wait()  # returns at once; raises what the send raised
    return True


def encode_header(tensor: torch.Tensor | None) -> torch.Tensor:
    """Dtype code, rank and sizes of ``tensor`` as an int64 tensor (zeros for None)."""
    if tensor is None:
        return torch.zeros(_HEADER_LEN, dtype=torch.int64)
    if tensor.dim() > _HEADER_LEN - 2:
        raise ValueError(f"pipeline activations of rank > {_HEADER_LEN - 2} are not supported")
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"pipeline activations and outputs of dtype {tensor.dtype} are not supported; "
                         f"use one of {', '.join(str(d).removeprefix('torch.') for d in _DTYPES)}")
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[0] = _DTYPES.index(tensor.dtype)
    header[1] = tensor.dim()
    header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    values = header.tolist()
    return tuple(values[2:2 + values[1]]), _DTYPES[values[0]]


def broadcast_any(value: Any, group: ICommunicationBackend, src: int, device: torch.device) -> Any:
    """``value`` (a tensor, or a tuple, list or dict of them: ``pipeline_outputs``) from rank
    ``src`` to every rank of ``group``, which need not know its structure or shapes; received on
    ``device``. A tensor costs two broadcasts (header, data); a structure one more (its layout,
    announced by the first header) and two per tensor."""
    if group.rank == src:
        if isinstance(value, torch.Tensor):
            return _broadcast_tensor(value, group, src, device)
        layout, leaves = flatten_output(value)
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        header[0], header[1] = _STRUCTURE, len(layout)
        group.broadcast(header, src)
        group.broadcast(torch.tensor(layout, dtype=torch.int64), src)
        sent = iter(leaves)
        return unflatten_output(layout, lambda: _broadcast_tensor(next(sent), group, src, device))
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    group.broadcast(header, src)
    if int(header[0]) != _STRUCTURE:
        return _receive_tensor(header, group, src, device)
    codes = torch.zeros(int(header[1]), dtype=torch.int64)
    group.broadcast(codes, src)
    return unflatten_output(codes.tolist(), lambda: _broadcast_tensor(None, group, src, device))


def _broadcast_tensor(tensor: torch.Tensor | None, group: ICommunicationBackend, src: int,
                      device: torch.device) -> torch.Tensor:
    """One tensor (header, then data) from ``src``; pass None on the other ranks."""
    if group.rank == src:
        group.broadcast(encode_header(tensor), src)
        out = tensor.contiguous()
        group.broadcast(out, src)
        return out
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    group.broadcast(header, src)
    return _receive_tensor(header, group, src, device)


def _receive_tensor(header: torch.Tensor, group: ICommunicationBackend, src: int,
                    device: torch.device) -> torch.Tensor:
    shape, dtype = decode_header(header)
    out = torch.empty(shape, dtype=dtype, device=device)
    group.broadcast(out, src)
    return out
