"""SentMessages: each rank describes the point-to-point messages it sends (shape, dtype, size, the
tag the transport sees) in memory that its same-node peers can read, so that a receive of the
wrong shape or dtype raises ``CollectiveMismatchError`` outside ``debug`` mode too. MPI compares
after a receive of the right byte count (``mpi_p2p``, [Note: what a receive checks]), Gloo before
and after a receive whose message its tag fingerprint would let through (``torch_dist_p2p``,
[Note: what a Gloo receive checks]).

[Note: the sent-message table] Each rank owns ``ENTRIES`` entries of ``ENTRY_BYTES`` in a map of its
own (MPI: its progress board's, after the call slots, ``mpi_progress``; Gloo: one per group,
``exchanged_sent_messages``). Message ``seq`` to rank ``dst`` with ``tag`` goes to entry
``hash((dst, tag, seq)) % ENTRIES`` (a tuple of ints hashes the same in every process), written
before the message is sent, the way a call slot is written: -1 in the first word (readers skip
the entry), then the receiver, the tag, the message's shape and dtype as the call slots describe
a call (``call_slots.packed_call``), its size in bytes and its tag on the wire, then ``seq`` in
the first word. A reader reads ``seq``, the fields, then ``seq`` again, and uses the fields only
when both reads give the message it asks about and they name it as the receiver, with the tag
(x86 keeps a writer's stores and a reader's loads in order). An entry overwritten by a later
message (128 entries per sender), a sender on another node, or one whose backend is closed: the
message goes unchecked (``debug=True`` checks every message). It costs about 1 us of Python per
message on each side warm, 2 us in a tight ping-pong (a round trip of 4 float32 between two MPI
ranks went from 17 to 25 us on a 2-core machine).
"""
from __future__ import annotations

import contextlib
import mmap
import struct
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from distframe.backends.call_slots import (PACKED_BYTES, close_map, describe_packed, exchanged_maps,
                                           packed_call)

ENTRIES = 128
ENTRY_BYTES = 128
AREA_BYTES = ENTRIES * ENTRY_BYTES
_WORD = struct.Struct("<q")
_PEER_AND_TAG = struct.Struct("<qq")
_HEAD_BYTES = _PEER_AND_TAG.size
_NBYTES_AT = _HEAD_BYTES + PACKED_BYTES  # within the fields
_FIELDS_END = 8 + _NBYTES_AT + _WORD.size  # the seq word, then the fields (compared as bytes)
_WIRE_TAG_AT = _FIELDS_END  # the tag on the wire: the transport's, not compared
if _WIRE_TAG_AT + _WORD.size > ENTRY_BYTES:
    raise RuntimeError("a sent-message entry does not fit in ENTRY_BYTES")
_FIELDS_CACHE: dict[tuple[Any, ...], bytes] = {}
_MAX_CACHED = 4096


class OtherMessage(NamedTuple):
    """A message that differs from the receive that asks about it: what was sent, as
    ``send(shape=..., dtype=...)``, its size in bytes and the tag the transport saw."""

    description: str
    nbytes: int
    wire_tag: int


#: What ``SentMessages.compare`` returns for a message of the receive's shape and dtype.
MATCHES = OtherMessage("", -1, -1)


class SentMessages:
    """This rank's entries (writable) and its same-node peers' (read-only), each at ``offset`` in
    its map ([Note: the sent-message table]); ``close`` unmaps them when ``owns_maps``, else the
    maps stay the caller's."""

    def __init__(self, own: mmap.mmap, peers: dict[int, mmap.mmap], rank: int, offset: int, *,
                 owns_maps: bool = False) -> None:
        self._own: mmap.mmap | None = own
        self._peers, self._rank, self._offset = dict(peers), rank, offset
        self._maps = [own, *peers.values()] if owns_maps else []

    def record(self, dst: int, tag: int, seq: int, tensor: Any, wire_tag: int | None = None) -> None:
        """Describes message ``seq`` to ``dst`` with ``tag``: call it before sending it.
        ``wire_tag``: the tag the transport sees (Gloo's); without it the entry's is stale, and
        ``compare``'s ``OtherMessage.wire_tag`` meaningless (MPI, which never reads it)."""
        own = self._own
        if own is None or dst not in self._peers:  # a receiver on another node cannot read it
            return
        at = self._offset + hash((dst, tag, seq)) % ENTRIES * ENTRY_BYTES
        _WORD.pack_into(own, at, -1)  # the entry is being rewritten: readers skip it
        own[at + 8:at + _FIELDS_END] = _fields(dst, tag, tensor)
        if wire_tag is not None:
            _WORD.pack_into(own, at + _WIRE_TAG_AT, wire_tag)
        _WORD.pack_into(own, at, seq)

    def compare(self, src: int, tag: int, seq: int, tensor: Any) -> OtherMessage | None:
        """What rank ``src`` sent as message ``seq`` with ``tag`` to this rank, compared with
        ``tensor`` (the receive's): ``MATCHES`` when its shape and dtype are the same, an
        ``OtherMessage`` when they differ, None when the message's entry cannot be read."""
        view = self._peers.get(src)
        if view is None:
            return None
        at = self._offset + hash((self._rank, tag, seq)) % ENTRIES * ENTRY_BYTES
        try:
            if _WORD.unpack_from(view, at)[0] != seq:
                return None
            mine = _fields(self._rank, tag, tensor)
            theirs = view[at + 8:at + _FIELDS_END]
            wire_tag = None if theirs == mine else _WORD.unpack_from(view, at + _WIRE_TAG_AT)[0]
            if _WORD.unpack_from(view, at)[0] != seq:
                return None
        except ValueError:  # the map was closed meanwhile (a shutdown): unchecked
            return None
        if wire_tag is None:
            return MATCHES
        if theirs[:_HEAD_BYTES] != mine[:_HEAD_BYTES]:  # another channel's message
            return None
        return OtherMessage(describe_packed(theirs[_HEAD_BYTES:_NBYTES_AT]),
                            _WORD.unpack_from(theirs, _NBYTES_AT)[0], wire_tag)

    def sent_otherwise(self, src: int, tag: int, seq: int, tensor: Any) -> str | None:
        """``compare``'s description of a message that differs from ``tensor``; None when it
        does not, or when the message's entry cannot be read."""
        other = self.compare(src, tag, seq, tensor)
        return None if other is None or other is MATCHES else other.description

    def close(self) -> None:
        self._own, self._peers = None, {}
        maps, self._maps = self._maps, []
        for m in maps:
            close_map(m)


@contextlib.contextmanager
def exchanged_sent_messages(set_key: Callable[[str, str], None], get_key: Callable[[str], str | bytes],
                            rank: int, world_size: int) -> Iterator[SentMessages]:
    """A sent-message table of its own for a group whose members meet through a key-value store,
    as the call slots are made (``call_slots.exchanged_maps``)."""
    with exchanged_maps(set_key, get_key, rank, world_size, AREA_BYTES, "distframe-sent-") as (own, peers):
        yield SentMessages(own, peers, rank, 0, owns_maps=True)


def _fields(receiver: int, tag: int, tensor: Any) -> bytes:
    """An entry's compared fields for a message of ``tensor`` to ``receiver`` with ``tag``: the
    receiver and the tag, the shape and dtype as the call slots pack a call's, then the size in
    bytes, from a cache."""
    key = (receiver, tag, tensor.dtype, tensor.shape)
    fields = _FIELDS_CACHE.get(key)
    if fields is None:
        nbytes = _WORD.pack(tensor.numel() * tensor.element_size())
        fields = _PEER_AND_TAG.pack(receiver, tag) + packed_call("send", key[3], key[2], ()) + nbytes
        if len(_FIELDS_CACHE) >= _MAX_CACHED:
            _FIELDS_CACHE.clear()
        _FIELDS_CACHE[key] = fields
    return fields
