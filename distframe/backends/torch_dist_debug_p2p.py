"""Point to point on the torch.distributed engines in ``debug`` mode: the payloads' receives of a
channel are posted in message order (``torch_dist_p2p`` has the receive itself).

[Note: debug payloads in message order] In debug mode a message is a header (``HEADER_TAG`` above
the user's tag) and a payload, whose tag on the wire carries the message's number modulo 512
(``debug_payload_tag``). A receive posts its header's receive at once and its payload's only once
the header has arrived and matched, at its first wait: a payload larger than its buffer would end
the process inside Gloo. Gloo gives a payload's receive the oldest unreceived message of its tag,
so a receive held open while 512 later messages of its channel were received had its payload
taken by message 513's receive, and took message 513's itself: swapped without a word where the
two had one shape. So posting a payload's receive first posts those of every earlier message of
its channel, in order (``DebugPayloads.post_through``). Their headers have arrived, so this never
waits: Gloo matches one channel's headers in the order their receives were posted, on one
connection, and the later header has arrived. A payload's receive then never meets a message of
its tag that an earlier receive should take, whatever the number's modulus.

A header of another shape or dtype (``CollectiveMismatchError`` in every wait of its receive):
the payload is taken into a buffer of the size the header gives, so the channel stays in step.
Where the header cannot give it (a tensor of more than 8 dims) the payload stays unreceived, and
a later receive whose payload has its tag on the wire raises instead of taking it.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distframe.backends.torch_dist_p2p import RecvWork


class DebugPayloads:
    """The debug-mode receives of one group whose payloads' receives are not posted yet, by
    channel (sender, user tag) and in message order, and the tags on the wire of the payloads
    left unreceived ([Note: debug payloads in message order])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unposted: dict[tuple[int, int], deque[RecvWork]] = {}
        self._unreceived: dict[tuple[int, int], set[int]] = {}

    def opened(self, receive: RecvWork) -> None:
        """Called as ``receive`` posts its header's receive (receives are numbered in that order)."""
        with self._lock:
            self._unposted.setdefault((receive._src, receive._tag), deque()).append(receive)

    def post_through(self, receive: RecvWork) -> None:
        """Posts the payloads' receives of ``receive``'s channel up to its own, in message order,
        once its header has arrived; each receive keeps what it found (``post_payload``)."""
        channel = (receive._src, receive._tag)
        with self._lock:
            waiting = self._unposted.get(channel)
            unreceived = self._unreceived.setdefault(channel, set())
            while waiting and waiting[0]._seq <= receive._seq:
                waiting.popleft().post_payload(unreceived)
            if not waiting:
                self._unposted.pop(channel, None)
