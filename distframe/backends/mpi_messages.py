"""SentMessages: each MPI rank describes the point-to-point messages it sends (shape, dtype) in
memory that its same-node peers can read, so that a receive of the right byte count but another
shape or dtype raises ``CollectiveMismatchError`` outside ``debug`` mode too (``mpi_p2p``,
[Note: what a receive checks]).

[Note: the sent-message table] Each rank owns ``ENTRIES`` entries of ``ENTRY_BYTES`` in its progress
board's map (``mpi_progress``), after the call slots. Message ``seq`` to rank ``dst`` with ``tag``
goes to entry ``hash((dst, tag, seq)) % ENTRIES`` (a tuple of ints hashes the same in every
process), written before the message is sent, the way a call slot is written: -1 in the first
word (readers skip the entry), then the receiver, the tag and the message's shape and dtype as
the call slots describe a call (``call_slots.packed_call``), then ``seq`` in the first word. A
reader reads ``seq``, the fields, then ``seq`` again, and uses the fields only when both reads
give the message it asks about and they name it as the receiver, with the tag. The receiver
reads the entry once its receive has completed (the sender wrote it before sending; x86 keeps
those stores in order). An entry overwritten by a later message (128 entries per sender), a
sender on another node, or one whose backend is closed: the message goes unchecked
(``debug=True`` checks every message). It costs about 1 us of Python per message on each side
warm, 2 us in a tight ping-pong (a round trip of 4 float32 between two MPI ranks went from 17 to
25 us on a 2-core machine), like the fingerprint Gloo's messages carry in their tag.
"""
from __future__ import annotations

import mmap
import struct
from typing import Any

from distframe.backends.call_slots import PACKED_BYTES, describe_packed, packed_call

ENTRIES = 128
ENTRY_BYTES = 128
AREA_BYTES = ENTRIES * ENTRY_BYTES
_SEQ = struct.Struct("<q")
_PEER_AND_TAG = struct.Struct("<qq")
_FIELDS_END = 8 + _PEER_AND_TAG.size + PACKED_BYTES
if _FIELDS_END > ENTRY_BYTES:
    raise RuntimeError("a sent-message entry does not fit in ENTRY_BYTES")
_HEAD_BYTES = _PEER_AND_TAG.size
_FIELDS_CACHE: dict[tuple[Any, ...], bytes] = {}
_MAX_CACHED = 4096


class SentMessages:
    """This rank's entries (writable) and its same-node peers' (read-only), each at ``offset`` in
    its map; the maps stay the caller's ([Note: the sent-message table])."""

    def __init__(self, own: mmap.mmap, peers: dict[int, mmap.mmap], rank: int, offset: int) -> None:
        self._own: mmap.mmap | None = own
        self._peers, self._rank, self._offset = dict(peers), rank, offset

    def record(self, dst: int, tag: int, seq: int, tensor: Any) -> None:
        """Describes message ``seq`` to ``dst`` with ``tag``: call it before sending it."""
        own = self._own
        if own is None or dst not in self._peers:  # a receiver on another node cannot read it
            return
        at = self._offset + hash((dst, tag, seq)) % ENTRIES * ENTRY_BYTES
        _SEQ.pack_into(own, at, -1)  # the entry is being rewritten: readers skip it
        own[at + 8:at + _FIELDS_END] = _fields(dst, tag, tensor)
        _SEQ.pack_into(own, at, seq)

    def sent_otherwise(self, src: int, tag: int, seq: int, tensor: Any) -> str | None:
        """What rank ``src`` sent as message ``seq`` with ``tag`` to this rank when that differs in
        shape or dtype from ``tensor`` (the receive's), as ``send(shape=..., dtype=...)``; None
        when it does not, or when the message's entry cannot be read."""
        view = self._peers.get(src)
        if view is None:
            return None
        at = self._offset + hash((self._rank, tag, seq)) % ENTRIES * ENTRY_BYTES
        if _SEQ.unpack_from(view, at)[0] != seq:
            return None
        theirs = view[at + 8:at + _FIELDS_END]
        mine = _fields(self._rank, tag, tensor)
        if (_SEQ.unpack_from(view, at)[0] != seq or theirs == mine
                or theirs[:_HEAD_BYTES] != mine[:_HEAD_BYTES]):  # the same, or another channel's message
            return None
        return describe_packed(theirs[_HEAD_BYTES:])

    def close(self) -> None:
        self._own, self._peers = None, {}


def _fields(receiver: int, tag: int, tensor: Any) -> bytes:
    """An entry's fields for a message of ``tensor`` to ``receiver`` with ``tag``: the receiver and
    the tag, then the shape and dtype as the call slots pack a call's, from a cache."""
    key = (receiver, tag, tensor.dtype, tensor.shape)
    fields = _FIELDS_CACHE.get(key)
    if fields is None:
        fields = _PEER_AND_TAG.pack(receiver, tag) + packed_call("send", key[3], key[2], ())
        if len(_FIELDS_CACHE) >= _MAX_CACHED:
            _FIELDS_CACHE.clear()
        _FIELDS_CACHE[key] = fields
    return fields
