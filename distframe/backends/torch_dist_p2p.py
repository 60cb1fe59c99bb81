"""Point to point on the torch.distributed engines (see ``torch_dist_engine``, [Note: point to
point]): a posted receive and what it checks (the unfinished sends a shutdown waits for are in
``torch_dist_sends``). On Gloo, a receive from a rank that has left without sending the message
stops at once (``torch_dist_board``, [Note: watching a receive]).

[Note: the message's shape in its tag] Gloo delivers a message into the first receive posted on
its (sender, tag) slot whatever that receive's size: a message larger than the buffer ends the
receiving process (an enforce on Gloo's own thread, then std::terminate), and one that fits is
written into its first bytes, whatever the dtype or shape, without a word. So outside ``debug``
mode both sides put a fingerprint of the tensor's (dtype, shape) and of the message's number on
its channel (``_count_p2p``) in the high bits of the tag Gloo sees (``message_tag``): a message of
another shape or dtype never matches the receive, which then times out, within the backend's
timeout, with ``CollectiveTimeoutError`` saying that this may be the cause and that
``debug=True`` names both sides (it costs a header per message). The number keeps Gloo's order
within a channel: without it, the receive of message n would take a later message that happens
to have its shape, leaving message n unreceived. This sends nothing more (it costs about 2 us of
Python per message: a cached hash and two multiplications), but has ``FINGERPRINT_BITS`` bits: a
mismatched pair shares a fingerprint with probability 2**-10, and Gloo then delivers the message
(for message 1 on tag 5, 8 and 1779 float32 do): the sender's description catches it where it
can be read ([Note: what a Gloo receive checks]). Gloo takes any tag in 0..2**31 - 1 (a C int;
none is truncated, checked on torch 2.13); user tags are below 2**20 (``composed.RESERVED_TAG``,
which the composed all_to_all uses) and debug headers add 2**21, so the fingerprint takes bits 21
to 30; a debug header never meets a fingerprinted message, since every rank of a group runs in
the same mode. NCCL ignores tags.

[Note: what a Gloo receive checks] Outside ``debug`` mode a Gloo sender describes each message,
before sending it, in its group's sent-message table, in shared memory that its same-node peers
read (``sent_messages``, [Note: the sent-message table]): shape, dtype, size in bytes and the tag
Gloo sees. A receive reads its message's entry:

* before it posts (``_post_payload``): a message of its shape and dtype needs no further look.
  One of another shape or dtype on the same tag on the wire (a shared fingerprint), which Gloo
  would deliver into this receive, is refused: the receive takes it into a buffer of its size
  instead, and every wait raises ``CollectiveMismatchError`` naming both sides; the receive's
  tensor is left as it was. One on another tag on the wire never matches: the receive is
  posted as before and times out, as above (refusing it too would make the error, at once or
  at the timeout, depend on which rank came first).
* once its message has arrived, when the entry could not be read before (the receive was posted
  before the sender described its message): a message of another shape or dtype (a smaller one
  that shares the fingerprint) raises ``CollectiveMismatchError`` in every wait
  (``_other_message``); Gloo has written its bytes at the start of the receive's tensor, when
  the receive was posted on that tensor, and the error says so.

Either way the message is received, so the sender's send completes as any other and its
shutdown has nothing to drop, the sender sees no error (the error is the receive's outcome, as
on MPI), and the next receive on the channel gets the next message: the group stays usable.
What is left to the fingerprint alone, about one mismatched pair in 2**10: a message larger
than its receive that shares its fingerprint, when the receive was posted before the sender
described the message, still ends the receiving process inside Gloo (nothing runs between
Gloo's arrival and its check of the size); and a message from a sender on another node, or
whose entry a later message overwrote before the receive read it (``sent_messages.ENTRIES``
per sender), is delivered unchecked. ``debug=True`` checks every message from any node. The
table adds no message and no round trip: the sender writes an entry, the receive reads it once
or twice: 1 to 3 us of CPU per send and per receive, as MPI's table (measured side by side on a
loaded 2-core machine, where a 4 KB Gloo ring step between two ranks took about 100 us of CPU in
the calling thread). NCCL, which ignores tags, has no table: its receives are checked only
with ``debug=True``."""
from __future__ import annotations

import functools
import hashlib
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import torch

from distframe.backends.departures import in_world, receive_departure_error
from distframe.backends.sent_messages import MATCHES, OtherMessage
from distframe.backends.signature import ENCODED_LENGTH, Signature
from distframe.backends.torch_dist_board import _CUT, DEPARTURE_SETTLE_S, WatchedWait, peer_lost
from distframe.backends.torch_dist_wire import movable
from distframe.backends.types import Work
from distframe.backends.validation import check_wait_timeout, is_dense
from distframe.errors import CollectiveMismatchError, CollectiveTimeoutError

if TYPE_CHECKING:
    from distframe.backends.torch_dist_engine import TorchDistributedBackend

# Debug-mode headers of point-to-point messages travel on the user's tag plus this offset
# (user tags are below 2**20, see composed.RESERVED_TAG).
HEADER_TAG = 2**21
FINGERPRINT_SHIFT = 21  # see [Note: the message's shape in its tag]
FINGERPRINT_BITS = 10


def message_tag(tag: int, tensor: torch.Tensor, seq: int) -> int:
    """The tag Gloo sees for message ``seq`` of ``tensor`` on the channel with user tag ``tag``,
    outside debug mode ([Note: the message's shape in its tag])."""
    mixed = ((_fingerprint(tensor.dtype, tuple(tensor.shape)) ^ (seq * 0x9E3779B9)) * 0x85EBCA6B)
    return tag | ((mixed & 0xFFFFFFFF) >> (32 - FINGERPRINT_BITS) << FINGERPRINT_SHIFT)


def debug_payload_tag(tag: int, seq: int) -> int:
    """The tag Gloo sees for the payload of message ``seq`` on the channel with user tag ``tag`` in
    debug mode: the message's number (mod 512) in bits 22-30, clear of ``HEADER_TAG``'s bit 21.
    Its receive is posted once its header has arrived, after those of the channel's earlier
    messages (``torch_dist_debug_p2p``, [Note: debug payloads in message order])."""
    return tag | ((seq & 0x1FF) << 22)


@functools.lru_cache(maxsize=4096)
def _fingerprint(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    # Not hash(): a str's hash differs between processes.
    return int.from_bytes(hashlib.blake2b(f"{dtype}{shape}".encode(), digest_size=4).digest(), "little")


def mismatch_hint(backend: TorchDistributedBackend, tensor: torch.Tensor, src: int, tag: int) -> str:
    """What a receive that did not complete adds to its timeout error outside debug mode."""
    if backend.debug:
        return ""
    expected = f"(shape={tuple(tensor.shape)}, dtype={str(tensor.dtype).removeprefix('torch.')})"
    return (f"; perhaps rank {src} sent the message with tag {tag} in another shape or dtype than "
            f"this receive's {expected}: such a message never matches it (run with debug=True to "
            "see both)")


class RecvWork(Work):
    """A posted receive. In debug mode the payload's receive is posted only after the header
    matched, so a mismatch raises here instead of aborting the process, and after those of the
    channel's earlier messages ([Note: debug payloads in message order]).

    [Note: a receive's own timeout] When a receive's ``wait(timeout)`` expires, Gloo closes the
    connection to the sender (NCCL marks the work failed), which broke every later call with that
    rank and marked the group failed; the other engines leave the receive posted. So
    ``wait(timeout=...)`` runs the whole wait, bounded by the backend's timeout as a plain
    ``wait()`` is, on a thread of its own and stops waiting for that thread at the caller's
    timeout: the receive stays posted, and a later wait completes it."""

    def __init__(self, backend: TorchDistributedBackend, tensor: torch.Tensor, src: int, tag: int,
                 seq: int) -> None:
        self._backend, self._tensor, self._src, self._tag, self._seq = backend, tensor, src, tag, seq
        direct = is_dense(tensor) and tensor.device == backend._device
        self._buffer = tensor if direct else torch.empty(tensor.shape, dtype=tensor.dtype,
                                                         device=backend._device)
        self._done = False
        self._waiter: Future | None = None  # the thread's outcome ([Note: a receive's own timeout])
        self._header: torch.Tensor | None = None
        self._header_work = self._payload_work = None
        self._error: Exception | None = None  # raised by every wait once found
        # [Note: what a Gloo receive checks]: the message refused before posting; whether to
        # read the sender's description once the message has arrived.
        self._refused: OtherMessage | None = None
        self._compare_after = False
        if backend.debug:
            self._header = torch.empty(ENCODED_LENGTH, dtype=torch.int64, device=backend._device)
            self._header_lock, self._header_arrived = threading.Lock(), False
            self._header_work = self._post(self._header, tag + HEADER_TAG)
            backend._debug_payloads.opened(self)
        else:
            self._payload_work = self._post_payload(message_tag(tag, tensor, seq))

    def _post_payload(self, wire_tag: int) -> Any:
        """Posts the receive outside debug mode, after reading the sender's description of the
        message where it can ([Note: what a Gloo receive checks])."""
        table = self._backend._sent_messages
        if table is None:  # NCCL
            return self._post(movable(self._buffer), wire_tag)
        sent = table.compare(self._src, self._tag, self._seq, self._tensor)
        if sent is not None and sent is not MATCHES and sent.wire_tag == wire_tag:
            # Gloo would deliver it here. Taken into a buffer of its size instead, the sender's
            # send completes and the next receive on the channel gets the next message.
            self._refused = sent
            self._buffer = torch.empty(sent.nbytes, dtype=torch.uint8, device=self._backend._device)
        self._compare_after = sent is not MATCHES and self._refused is None
        return self._post(movable(self._buffer), wire_tag)

    def _post(self, buffer: torch.Tensor, wire_tag: int) -> Any:
        """Posts the receive of ``buffer``; a connection already closed (Gloo raises at once when
        the sender has shut its group down) raises the error ``_failure`` finds for it."""
        try:
            return self._backend._pg.recv([buffer], self._src, wire_tag)
        except RuntimeError as exc:
            error = self._failure(exc, 0.0, None)
            if error is None:
                raise
            raise error from exc

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        timeout = check_wait_timeout(timeout)
        if self._done:
            if self._error is not None:
                raise self._error
            return self._tensor
        if timeout is not None or self._waiter is not None:
            return self._wait_on_thread(timeout)
        return self._wait_here()

    def _wait_here(self) -> torch.Tensor:
        """Waits for the receive on this thread, within the backend's timeout."""
        if self._payload_work is None and self._error is None:  # debug mode, first wait
            self._await_header()
            self._backend._debug_payloads.post_through(self)
        if self._payload_work is not None:
            self._await(self._payload_work)
        error = self._error or self._other_message()
        if error is None and self._buffer is not self._tensor:
            try:
                self._tensor.copy_(self._buffer)
            except Exception as exc:  # noqa: BLE001 - the message is taken: every wait raises it
                error = exc
        if error is not None:
            self._done, self._error = True, error
            raise error
        self._done = True
        return self._tensor

    def _other_message(self) -> CollectiveMismatchError | None:
        """The error for a message that arrived and differs from this receive in shape or dtype:
        refused before the receive was posted, or described by its sender by the time it arrived
        ([Note: what a Gloo receive checks]); None when neither."""
        sent, held = self._refused, False
        if self._compare_after:
            sent = self._backend._sent_messages.compare(self._src, self._tag, self._seq, self._tensor)
            if sent is None or sent is MATCHES:
                return None
            held = self._buffer is self._tensor
        if sent is None:
            return None
        expected = Signature("send", tuple(self._tensor.shape), self._tensor.dtype).describe()
        where = ("this receive's tensor now holds the bytes Gloo delivered at its start" if held
                 else "this receive's tensor is left as it was")
        return CollectiveMismatchError(
            "recv", self._seq, f"rank {self._src} sent {sent.description} with tag {self._tag}, rank "
            f"{self._backend.rank} expects {expected} ({where}; seen through this node's shared memory)")

    def is_completed(self) -> bool:
        """True once the message is in the tensor, or the receive has failed (``wait`` raises why).
        A Gloo receive says it has completed only to a wait, and a debug-mode payload is posted
        only once its header has arrived, so asking its work stayed False for good and a loop
        polling this never ended: the first call starts the waiting thread, later ones ask it."""
        if self._done:
            return True
        return self._start_waiter().done()

    def _start_waiter(self) -> Future:
        if self._waiter is None:
            self._waiter = Future()
            threading.Thread(target=self._wait_for_waiter, name="distframe-recv-wait", daemon=True).start()
        return self._waiter

    def _wait_on_thread(self, timeout: float | None) -> torch.Tensor:
        self._start_waiter()
        try:
            return self._waiter.result(timeout)
        except FutureTimeout:
            if self._waiter.done():
                raise
            hint = mismatch_hint(self._backend, self._tensor, self._src, self._tag)
            raise in_world(CollectiveTimeoutError(
                "recv", self._seq, [self._src], timeout or 0.0,
                "Work.wait(timeout=...) expired; the receive stays posted, so a later wait() can "
                f"still complete it{hint}"), self._backend._world_ranks) from None

    def _wait_for_waiter(self) -> None:
        try:
            self._waiter.set_result(self._wait_here())
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's wait
            self._waiter.set_exception(exc)

    def _await(self, work: Any) -> None:
        """Waits for ``work`` within the process group's timeout (the backend's)."""
        backend = self._backend
        board = backend._shared.board
        watched = None
        if backend._wait_slice and self.stop_on_departure:  # not NCCL: its waits are not sliced
            key, src, tag, seq = backend._progress_keys[self._src], self._src, self._tag, self._seq
            watched = WatchedWait(lambda waited: receive_departure_error(
                board.departure(key), src, backend.rank, tag, seq, waited), lambda: work.wait(_CUT))
            board.watch(watched)
        start = time.monotonic()
        try:
            work.wait()
        except RuntimeError as exc:
            error = self._failure(exc, time.monotonic() - start, watched)
            if error is None:
                raise
            raise error from (None if watched is not None and error is watched.error else exc)
        finally:
            if watched is not None:
                board.unwatch(watched)

    def _failure(self, exc: RuntimeError, waited: float, watched: WatchedWait | None) -> Exception | None:
        """The distframe error for a receive that failed with ``exc`` (None: not a transport
        failure): the board's verdict on a watched receive, then, for a lost connection, a sender
        that left the group (``_sender_left``), else the engine's reading of ``exc``."""
        backend = self._backend
        error = watched.error if watched is not None else None
        if error is None and backend._wait_slice and self.stop_on_departure and peer_lost(exc):
            error = self._sender_left(waited)
        if error is not None:
            backend._shared.failed = True
            return in_world(error, backend._world_ranks)
        return backend._comm_error(exc, "recv", self._seq, [self._src], hint=mismatch_hint(
            backend, self._tensor, self._src, self._tag))

    def _sender_left(self, waited: float) -> Exception | None:
        """The error for a receive whose connection failed (Gloo: "Connection closed by peer")
        because its sender left the group, not because it died: the board's departure error, or,
        when the sender had sent this message, which never matched (another shape or dtype), what
        the timeout would have said. None if the sender did not leave (it failed), seen within
        ``DEPARTURE_SETTLE_S`` (its departure is recorded around its shutdown, not before it)."""
        backend = self._backend
        deadline = time.monotonic() + DEPARTURE_SETTLE_S
        departed = backend._shared.board.departure(backend._progress_keys[self._src])
        while departed is None and time.monotonic() < deadline:
            time.sleep(0.05)
            departed = backend._shared.board.departure(backend._progress_keys[self._src])
        if departed is None or departed.failed or departed.sent is None:
            return None
        error = receive_departure_error(departed, self._src, backend.rank, self._tag, self._seq, waited)
        if error is not None:
            return error
        return CollectiveTimeoutError(
            "recv", self._seq, [self._src], round(waited, 1),
            f"rank {self._src} left the group after sending message {self._seq} with tag {self._tag}, "
            "which never matched this receive" + mismatch_hint(backend, self._tensor, self._src, self._tag),
            early=True)

    def _await_header(self) -> None:
        """Waits for a debug-mode header once: a second wait on a Gloo receive's work waits for
        another message, until the timeout (another thread may be waiting for this one)."""
        with self._header_lock:
            if not self._header_arrived:
                self._await(self._header_work)
                self._header_arrived = True

    def post_payload(self, unreceived: set[int]) -> None:
        """Posts the payload's receive of this debug-mode receive once its header has arrived, in
        its channel's message order ([Note: debug payloads in message order]): into its buffer if
        the header matches, else into one of the size the header gives (every wait raises the
        mismatch). ``unreceived``: the channel's tags on the wire of payloads never received."""
        try:
            self._await_header()  # at once: this or a later message's header has arrived
            wire_tag = debug_payload_tag(self._tag, self._seq)
            if wire_tag in unreceived:
                self._error = CollectiveMismatchError("recv", self._seq, (
                    f"message {self._seq} from rank {self._src} with tag {self._tag} cannot be told "
                    "from the payload of an earlier message of another shape or dtype, still "
                    "unreceived on the same tag on the wire; the channel is out of step: rebuild the group"))
                return
            got = self._header.cpu()
            expected = Signature("send", tuple(self._tensor.shape), self._tensor.dtype)
            if bool((got == expected.encode(self._seq)).all()):
                self._payload_work = self._post(movable(self._buffer), wire_tag)
                return
            self._error = CollectiveMismatchError(
                "recv", self._seq, f"rank {self._src} sent {Signature.decode(got)} with tag "
                f"{self._tag}; rank {self._backend.rank} expects {expected.describe()}")
            nbytes = Signature.decode_nbytes(got)
            if nbytes is None:
                unreceived.add(wire_tag)
            else:  # taken, so the channel's next message is the next one received
                self._payload_work = self._post(torch.empty(nbytes, dtype=torch.uint8,
                                                            device=self._backend._device), wire_tag)
        except Exception as exc:  # noqa: BLE001 - raised by this receive's waits
            self._error = self._error or exc
