"""Point to point on the MPI engine (see ``mpi``): Isend/Irecv of a tensor's bytes, waited for
within a timeout, and a receive's check that the message is the one it expects.

[Note: what a receive checks] A receive compares the message's byte count with its buffer's: a
message of another size raises ``CollectiveMismatchError`` when the receive completes (a larger one
ends in MPI's truncation error, which says so too), and the channel stays in step (the next
receive gets the next message). MPI moves bytes and says nothing more, so a message of the same
byte count in another dtype or shape (4 float32 into 4 int32, shape (2, 3) into (3, 2)) came back
as its bytes. Now:

* outside ``debug`` mode, a sender on this node describes each message in shared memory before
  sending it (``mpi_messages``, [Note: the sent-message table]), and the receive compares that
  with its own shape and dtype once the message has arrived: a mismatch raises
  ``CollectiveMismatchError`` naming both (the bytes are in the receive's tensor by then, unless it
  was received through a buffer). A message from another node, or one whose description was
  overwritten (128 entries per sender), goes unchecked.
* with ``debug=True`` each message is preceded by a 128-byte header (``Signature.encode``: shape,
  dtype, the message's number on its channel) on the user's tag plus ``HEADER_TAG``, as on Gloo,
  and a receive takes the payload into a buffer of its own and compares the header with its own
  before it copies the payload over: a mismatch from any rank raises ``CollectiveMismatchError``
  naming both sides, and the caller's tensor is left as it was.

Gloo instead puts a fingerprint of (shape, dtype, message number) in the tag outside debug mode
(``torch_dist_p2p``, [Note: the message's shape in its tag]): a mismatched message never matches,
and the receive times out. That was not taken here: it would turn the size check's prompt error
into a timeout (300 s by default), and MPICH's tag bound (``MPI.TAG_UB``, 2**29 - 1) leaves 7
bits above the user's tags (below 2**20) and the debug headers' 2**21, so about one mismatch in
128 would still go through.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from distframe.backends.departures import in_world, receive_departure_error, send_departure_error
from distframe.backends.mpi_buffers import needs_staging, stage_in, wire, write_back
from distframe.backends.mpi_progress import wait_request
from distframe.backends.signature import ENCODED_LENGTH, Signature
from distframe.backends.types import Work
from distframe.backends.validation import check_wait_timeout
from distframe.errors import CollectiveMismatchError, CollectiveTimeoutError

if TYPE_CHECKING:
    from distframe.backends.mpi import MPICommunicationBackend

#: Debug-mode headers travel on the user's tag plus this (user tags are below 2**20), as on Gloo.
HEADER_TAG = 2**21


def isend_with_header(backend: MPICommunicationBackend, tensor: torch.Tensor, dst: int, tag: int,
                      seq: int) -> Work:
    """Starts the send of message ``seq`` on the channel (``dst``, ``tag``) in debug mode: its
    header, then its payload ([Note: what a receive checks])."""
    MPI, comm = backend._MPI, backend._comm
    host = stage_in(tensor, needs_staging(tensor, backend._device_aware))
    encoded = Signature("send", tuple(tensor.shape), tensor.dtype).encode(seq)
    header = (comm.Isend([wire(encoded), MPI.BYTE], dst, _header_tag(backend, tag)), encoded)
    request = comm.Isend([wire(host), MPI.BYTE], dst, tag)
    return P2PWork(backend, request, "send", seq, dst, tag, host, header=header)


def irecv_with_header(backend: MPICommunicationBackend, tensor: torch.Tensor, src: int, tag: int,
                      seq: int) -> Work:
    """Posts the receive of message ``seq`` on the channel (``src``, ``tag``) in debug mode: its
    header's, and its payload's into a buffer of its own, copied into ``tensor`` once the header
    matched ([Note: what a receive checks])."""
    MPI, comm = backend._MPI, backend._comm
    encoded = torch.empty(ENCODED_LENGTH, dtype=torch.int64)
    header = (comm.Irecv([wire(encoded), MPI.BYTE], src, _header_tag(backend, tag)), encoded)
    device = "cpu" if needs_staging(tensor, backend._device_aware) else tensor.device
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    request = comm.Irecv([wire(host), MPI.BYTE], src, tag)
    return P2PWork(backend, request, "recv", seq, src, tag, host, target=tensor, header=header)


def _header_tag(backend: MPICommunicationBackend, tag: int) -> int:
    wire_tag = tag + HEADER_TAG
    if wire_tag > backend._comm.Get_attr(backend._MPI.TAG_UB):
        raise ValueError(f"debug=True needs MPI tags up to {wire_tag} for its message headers, and this "
                         f"MPI allows up to {backend._comm.Get_attr(backend._MPI.TAG_UB)}: use a smaller "
                         "tag or debug=False")
    return wire_tag


class P2PWork(Work):
    """A pending Isend/Irecv; ``wait`` polls it within the timeout and checks a receive's size, or
    its header in debug mode (``header``: the header's request and buffer)."""

    def __init__(self, backend: MPICommunicationBackend, request: Any, op: str, seq: int,
                 peer: int, tag: int, buffer: torch.Tensor, target: torch.Tensor | None = None,
                 header: tuple[Any, torch.Tensor] | None = None) -> None:
        self._backend, self._request, self._op, self._seq = backend, request, op, seq
        self._peer, self._tag, self._buffer, self._target = peer, tag, buffer, target
        self._header = header
        self._status, self._done = backend._MPI.Status(), False
        # A receive of another size, or whose copy into its tensor raised: every wait raises it.
        self._error: Exception | None = None

    def wait(self, timeout: float | None = None) -> torch.Tensor | None:
        timeout = check_wait_timeout(timeout)
        if not self._done:
            limit = self._backend.timeout if timeout is None else timeout
            deadline = time.monotonic() + limit
            self._settle(lambda: self._wait_request(deadline, limit))
        if self._error is not None:
            raise self._error
        return self._target

    def _wait_request(self, deadline: float, limit: float) -> bool:
        on_stuck = lambda waited, timed_out: in_world(
            self._timed_out(limit) if timed_out else self._departed(waited), self._backend._world_ranks)
        if self._header is not None:
            wait_request(self._header[0], deadline, on_stuck)
            if self._op == "recv" and self._header_mismatch() is not None:
                return True
        wait_request(self._request, deadline, on_stuck, self._status)
        return True

    def is_completed(self) -> bool:
        """True once the message has moved (a receive of another size too: ``wait`` raises that)."""
        if not self._done:
            self._settle(lambda: self._request.Test(self._status) if self._header is None
                         else self._header[0].Test() and (self._header_mismatch() is not None
                                                          or self._request.Test(self._status)))
        return self._done

    def _settle(self, test: Callable[[], bool]) -> None:
        """Finishes the operation if ``test()`` (a wait or a Test) says it completed. A receive of a
        larger message ends in an MPI error, and the request is gone: recorded as the mismatch."""
        try:
            completed = test()
        except self._backend._MPI.Exception as exc:
            if exc.Get_error_class() != self._backend._MPI.ERR_TRUNCATE:
                raise
            self._done, self._error = True, self._mismatch(f"more than {self._buffer.nbytes}")
            return
        if completed:
            self._finish()

    def _finish(self) -> None:
        self._done = True
        if self._op != "recv":
            return
        if self._header is not None and (error := self._header_mismatch()) is not None:
            self._error = error
            # Its payload's receive stays posted, so that it takes that message and the next
            # receive on the channel gets the next one; MPI may still write its buffer.
            if not self._settled():
                self._backend._abandoned.append((self._request, self._buffer))
            return
        received = self._status.Get_count(self._backend._MPI.BYTE)
        if received != self._buffer.nbytes:
            self._error = self._mismatch(str(received))
            return
        if self._header is None:  # the sender's description, on this node ([Note: the sent-message table])
            sent = self._backend._board.sent.sent_otherwise(self._peer, self._tag, self._seq, self._target)
            if sent is not None:
                self._error = self._other_message(sent)
                return
        try:
            write_back(self._target, self._buffer)
        except Exception as exc:  # noqa: BLE001 - raised by every wait, as a mismatch is
            self._error = exc

    def _settled(self) -> bool:
        try:
            return self._request.Test()
        except self._backend._MPI.Exception:  # it completed, with an error (a truncated receive)
            return True

    def _header_mismatch(self) -> CollectiveMismatchError | None:
        """A debug-mode receive whose header names another shape or dtype (or message number)."""
        if self._op != "recv":
            return None
        t = self._target
        expected = Signature("send", tuple(t.shape), t.dtype)
        got = self._header[1]
        if bool((got == expected.encode(self._seq)).all()):
            return None
        return CollectiveMismatchError(
            "recv", self._seq, f"rank {self._peer} sent {Signature.decode(got)} with tag {self._tag}; "
            f"rank {self._backend.rank} expects {expected.describe()}")

    def __del__(self) -> None:
        # Dropped before it completed: MPI still reads or writes its buffer, which must outlive the
        # request; both stay with the backend, whose shutdown tests them (a later call may too).
        if not self._done:
            self._backend._abandoned.append((self._request, self._buffer))
            if self._header is not None:
                self._backend._abandoned.append(self._header)

    def _other_message(self, sent: str) -> CollectiveMismatchError:
        t = self._target
        expected = Signature("send", tuple(t.shape), t.dtype).describe()
        held = " (which this receive's tensor now holds)" if self._buffer is t else ""
        return CollectiveMismatchError(
            "recv", self._seq, f"rank {self._peer} sent {sent} with tag {self._tag}, rank "
            f"{self._backend.rank} expects {expected}: the same number of bytes{held}, in another "
            "shape or dtype (seen through this node's shared memory)")

    def _mismatch(self, received: str) -> CollectiveMismatchError:
        t = self._buffer
        return CollectiveMismatchError(
            "recv", self._seq, f"rank {self._peer} sent {received} bytes with tag {self._tag}, rank "
            f"{self._backend.rank} expects shape {tuple(t.shape)} {t.dtype} ({t.nbytes} bytes)")

    def _departed(self, waited: float) -> Exception | None:
        """The error for a receive whose sender, or a send whose receiver (a rendezvous send, not
        yet matched), on this node, left without sending or receiving the message."""
        departed = self._backend._board.departures().get(self._peer)
        left = receive_departure_error if self._op == "recv" else send_departure_error
        error = left(departed, self._peer, self._backend.rank, self._tag, self._seq, waited)
        if error is not None:
            self._abandon()
        return error

    def _timed_out(self, limit: float) -> CollectiveTimeoutError:
        self._abandon()
        what = "send a matching message" if self._op == "recv" else "receive the message"
        return CollectiveTimeoutError(self._op, self._seq, [self._peer], limit,
                                      f"rank {self._peer} did not {what} with tag {self._tag}")

    def _abandon(self) -> None:
        self._backend._abandoned.append((self._request, self._buffer))
        if self._header is not None:
            self._backend._abandoned.append(self._header)
