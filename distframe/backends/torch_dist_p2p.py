"""A posted point-to-point receive of the torch.distributed engines (see ``torch_dist_engine``,
[Note: point to point]). On Gloo, a receive from a rank that has left without sending the message
stops at once (``torch_dist_board``, [Note: watching a receive])."""
from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

import torch

from distframe.backends.signature import ENCODED_LENGTH, Signature
from distframe.backends.torch_dist_board import WatchedReceive
from distframe.backends.torch_dist_wire import movable
from distframe.backends.types import Work
from distframe.errors import CollectiveMismatchError

if TYPE_CHECKING:
    from distframe.backends.torch_dist_engine import TorchDistributedBackend

# Debug-mode headers of point-to-point messages travel on the user's tag plus this offset
# (user tags are below 2**20, see composed.RESERVED_TAG).
HEADER_TAG = 2**21


class RecvWork(Work):
    """A posted receive. In debug mode the payload's receive is posted only after the header
    matched, so a mismatch raises here instead of aborting the process."""

    def __init__(self, backend: TorchDistributedBackend, tensor: torch.Tensor, src: int, tag: int,
                 seq: int) -> None:
        self._backend, self._tensor, self._src, self._tag, self._seq = backend, tensor, src, tag, seq
        direct = tensor.is_contiguous() and tensor.device == backend._device
        self._buffer = tensor if direct else torch.empty(tensor.shape, dtype=tensor.dtype,
                                                         device=backend._device)
        self._done = False
        self._header: torch.Tensor | None = None
        self._header_work = self._payload_work = None
        if backend.debug:
            self._header = torch.empty(ENCODED_LENGTH, dtype=torch.int64, device=backend._device)
            self._header_work = backend._pg.recv([self._header], src, tag + HEADER_TAG)
        else:
            self._payload_work = backend._pg.recv([movable(self._buffer)], src, tag)

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        if self._done:
            return self._tensor
        if self._payload_work is None:
            self._await(self._header_work, timeout)
            self._check_header()
            self._payload_work = self._backend._pg.recv([movable(self._buffer)], self._src, self._tag)
        self._await(self._payload_work, timeout)
        if self._buffer is not self._tensor:
            self._tensor.copy_(self._buffer)
        self._done = True
        return self._tensor

    def is_completed(self) -> bool:
        return self._done or (self._payload_work is not None and self._payload_work.is_completed())

    def _await(self, work: Any, timeout: float | None) -> None:
        backend = self._backend
        board = backend._shared.board
        watched = None
        if backend._wait_slice and self.stop_on_departure:  # not NCCL: its waits are not sliced
            watched = WatchedReceive(work, self._src, backend._progress_keys[self._src], backend.rank,
                                     self._tag, self._seq)
            board.watch(watched)
        try:
            if timeout is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:
            error = watched.error if watched is not None else None
            if error is not None:
                backend._shared.failed = True
                raise error from None
            error = backend._comm_error(exc, "recv", self._seq, [self._src], timeout)
            if error is None:
                raise
            raise error from exc
        finally:
            if watched is not None:
                board.unwatch(watched)

    def _check_header(self) -> None:
        expected = Signature("send", tuple(self._tensor.shape), self._tensor.dtype)
        got = self._header.cpu()
        if not bool((got == expected.encode(self._seq)).all()):
            raise CollectiveMismatchError(
                "recv", self._seq, f"rank {self._src} sent {Signature.decode(got)} with tag "
                f"{self._tag}; rank {self._backend.rank} expects {expected.describe()}")
