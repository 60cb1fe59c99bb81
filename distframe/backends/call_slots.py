"""CallSlots: every rank writes what it is about to call into memory its same-node peers can read,
and reads theirs, so that ranks calling different ops, shapes or dtypes raise
``CollectiveMismatchError`` outside ``debug`` mode too.

[Note: why always on] MPI and Gloo compare nothing across ranks by themselves. Without a check, an
all_reduce of 4 float32 on one rank and 4 int32 on another returned bit patterns on both, one of 8
elements against one of 4 returned a half-reduced tensor under MPI, and Gloo ended the process
("Received data size doesn't match expected size"). ``debug=True`` all-gathers a signature
before every call (one small-message latency, and it reaches ranks on other nodes). This check
costs a few stores and reads of shared memory per call and covers the ranks of this node.

[Note: the slots] Each rank owns ``SLOTS`` slots of ``SLOT_BYTES``; call ``seq`` goes to slot
``seq % SLOTS``: first its description (op, dtype, number of dims, the first ``_DIMS`` dims, a
digest of the whole shape, a digest of the arguments that must agree: root, reduce op), then
``seq``. A reader reads ``seq``, the description, then ``seq`` again, and uses the description only
when both reads give the call it asks about (x86 keeps a writer's stores and a reader's loads in
order, so it never pairs a new ``seq`` with an old description). A peer more than ``SLOTS`` calls
ahead has overwritten the slot; a peer that has not arrived has not written it: both go unchecked.

[Note: who notices] A rank writes its slot, then (after a full memory barrier, so that two ranks
arriving together cannot both miss each other) reads its peers' slots for the same call, and
raises before issuing anything if one differs. So of two ranks that disagree at least the later
one raises before it issues; the earlier one may already have issued and waits: its engine asks
``CallSlots.error`` while it waits (where it asks about departures) and raises too. The group is then
unusable, as after a timeout.

[Note: after a mismatch] A rank whose part of a call completes without waiting (a root whose
broadcast was sent eagerly, a receiver the root served before the late rank came) never asks, and
returned from call ``seq`` as if nothing were wrong; its next call then hung until the timeout,
because the rank that raised never issued ``seq``. So a rank that finds a mismatch (``announce``
or ``error``) records it (``mismatch``) and marks its slots for the next ``SLOTS - 1`` calls: each
holds ``seq + k`` and, instead of a description, the mismatched call's op and number. A peer that
raced ahead reads such a mark where it compares its next call (``announce``, or ``error`` in its
wait), raises ``CollectiveMismatchError`` naming call ``seq`` and records it too. From then on
``announce`` raises it again before anything is written or issued: the marks stay in place, and a
peer is never left waiting for a call this rank will not make. It costs the hot path one
attribute test per call; the comparison that finds a mark is the one every call makes anyway.

[Note: after a timeout] A call a rank gave up on at its timeout can never complete: under MPI
its abandoned request even completed a late peer's call, which returned as if nothing were
wrong while the rank that gave up raised; under Gloo the late peer got the transport's
"Connection closed by peer". So the rank that gives up (``give_up``) marks its slots for that call
and the ``SLOTS - 1`` after it with ``_GAVE_UP``, the call's op and number, its timeout and the
ranks it found missing. A peer still waiting reads the mark where it asks ``error`` while it
waits, a late peer where ``announce`` compares its call, before it issues anything; each raises
``CollectiveTimeoutError`` naming the same call, number and missing ranks as the rank that gave
up, and records it: from then on ``announce`` refuses every call of the group, on the rank that
gave up too. (The in-memory engine keeps the same record in its rendezvous.)
"""
from __future__ import annotations

import contextlib
import mmap
import os
import socket
import struct
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from distframe.backends.departures import gave_up_error
from distframe.backends.signature import DTYPES, OPS, describe_mismatch
from distframe.backends.types import ReduceOp
from distframe.errors import CollectiveMismatchError, CollectiveTimeoutError

SLOTS = 64
SLOT_BYTES = 128
AREA_BYTES = SLOTS * SLOT_BYTES
_DIMS = 4
# op, dtype, ndim (-1: no shape), _DIMS dims, digest of the shape, digest of the arguments.
_WORDS_COUNT = 5 + _DIMS
_WORDS = struct.Struct(f"<{_WORDS_COUNT}q")
_SEQ = struct.Struct("<q")
_OP_CODES = {op: i for i, op in enumerate(OPS)}
_DTYPE_CODES = {dtype: i for i, dtype in enumerate(DTYPES)}
_ARGS_CODES: dict[Any, int] = {}
_ARGS_BY_CODE: dict[int, Any] = {}
_PACKED: dict[Any, bytes] = {}
_NO_SHAPE = (-1,) * (_DIMS + 2)
_PADS = [(-1,) * k for k in range(_DIMS + 1)]
_FIELDS_END = 8 + _WORDS.size
PACKED_BYTES = _WORDS.size  # of what packed_call returns
_MAX_CACHED = 4096
_MARK = -2  # the op word of a slot marked after a mismatch: [Note: after a mismatch]
_GAVE_UP = -3  # the op word of a slot marked after a timeout: [Note: after a timeout]
_MASK_WORDS, _MASK_BITS = _WORDS_COUNT - 4, 63  # the missing ranks, as bits of the last words
_UNUSABLE = "the group is unusable now, shut it down"


def args_code(args: Any) -> int:
    """The same int in every process for equal ``args`` (repr-based; ``hash`` of a str is not)."""
    try:
        code = _ARGS_CODES.get(args)
    except TypeError:  # a list inside (new_group's ranks)
        return zlib.crc32(repr(args).encode())
    if code is None:
        code = zlib.crc32(repr(args).encode())
        if len(_ARGS_CODES) < _MAX_CACHED:
            _ARGS_CODES[args] = code
            _ARGS_BY_CODE[code] = args
    return code


for _op in ReduceOp:  # so that a peer's reduce op reads as a name, even one this rank never used
    args_code((("op", _op.name),))


def call_words(op: str, shape: Any, dtype: Any, args: Any) -> tuple[int, ...]:
    """What a slot holds for a call (``shape`` None where ranks may differ: scatter's receivers)."""
    if shape is None:
        dims: tuple[int, ...] = _NO_SHAPE
    else:
        shape = tuple(shape)  # a tuple of ints hashes the same in every process (a str does not)
        n = len(shape)
        dims = ((n, *shape, *_PADS[_DIMS - n], hash(shape)) if n <= _DIMS
                else (n, *shape[:_DIMS], hash(shape)))
    return (_OP_CODES[op], _DTYPE_CODES.get(dtype, -1), *dims, args_code(args))


def packed_call(op: str, shape: Any, dtype: Any, args: Any) -> bytes:
    """``call_words`` packed as a slot holds them, from a cache (a training loop repeats its calls)."""
    key = (op, None if shape is None else tuple(shape), dtype, args)
    try:
        packed = _PACKED.get(key)
    except TypeError:  # a list inside (new_group's ranks)
        return _WORDS.pack(*call_words(op, shape, dtype, args))
    if packed is None:
        packed = _WORDS.pack(*call_words(op, shape, dtype, args))
        if len(_PACKED) >= _MAX_CACHED:
            _PACKED.clear()
        _PACKED[key] = packed
    return packed


def describe_packed(packed: bytes) -> str:
    """``describe_words`` of words as ``packed_call`` packs them."""
    return describe_words(_WORDS.unpack(packed))


def describe_words(words: tuple[int, ...]) -> str:
    op = OPS[words[0]] if 0 <= words[0] < len(OPS) else f"op#{words[0]}"
    parts, ndim = [], words[2]
    if ndim >= 0:
        dims = ", ".join(str(d) for d in words[3:3 + min(ndim, _DIMS)])
        parts.append(f"shape=({dims}{', ...' if ndim > _DIMS else ',' if ndim == 1 else ''})")
    if 0 < words[1] < len(DTYPES):
        parts.append(f"dtype={str(DTYPES[words[1]]).removeprefix('torch.')}")
    args = _ARGS_BY_CODE.get(words[-1])
    if args is not None:
        parts.extend(f"{k}={v}" for k, v in args)
    elif words[-1] != args_code(()):
        parts.append(f"args#{words[-1] & 0xFFFF:04x}")
    return f"{op}({', '.join(parts)})"


class CallSlots:
    """This rank's slots (writable) and its same-node peers' (read-only), each at ``offset`` in
    its map; ``close`` unmaps them when ``owns_maps``, else they stay the caller's."""

    def __init__(self, own: mmap.mmap, peers: dict[int, mmap.mmap], rank: int, offset: int = 0, *,
                 owns_maps: bool = False) -> None:
        self._own, self._peers, self._rank, self._offset = own, dict(peers), rank, offset
        self._owns_maps = owns_maps
        self._fence = threading.Lock()
        self.last: tuple[int, bytes] | None = None  # (seq, packed words) last announced
        #: (op, seq, what differed, how it was seen) of the first mismatch this rank found or
        #: learned of ([Note: after a mismatch]), else None.
        self.mismatch: tuple[str, int, str, str] | None = None
        #: (op, seq, missing ranks, timeout, the rank that gave up or None for this one) of the
        #: first call given up on at a timeout that this rank made or learned of, else None.
        self.gave_up: tuple[str, int, list[int] | None, float, int | None] | None = None
        #: The world rank of each rank of the group, for the errors after a timeout; None where
        #: they are the same ([Note: ranks of the world] in ``departures``). The engine sets it.
        self.world_ranks: list[int] | None = None

    def announce(self, op: str, seq: int, shape: Any, dtype: Any, args: Any) -> None:
        """Writes call ``seq`` into this rank's slot; raises CollectiveMismatchError, before the
        caller issues anything, if a same-node peer has written a different call ``seq`` or has
        found a mismatch before it, or if this rank has ([Note: after a mismatch])."""
        if self.mismatch is not None:
            raise self._refused(op, seq)
        if self.gave_up is not None:
            raise gave_up_error(*self.gave_up, op, seq, self.world_ranks)
        packed = packed_call(op, shape, dtype, args)
        own, at = self._own, self._offset + (seq % SLOTS) * SLOT_BYTES
        _SEQ.pack_into(own, at, -1)  # the slot is being rewritten: readers skip it
        own[at + 8:at + _FIELDS_END] = packed
        _SEQ.pack_into(own, at, seq)
        self.last = (seq, packed)
        with self._fence:  # a locked instruction: the stores above are visible before the reads
            pass
        for view in self._peers.values():
            if _SEQ.unpack_from(view, at)[0] == seq and view[at + 8:at + _FIELDS_END] != packed:
                error = self.error(op, seq)
                if error is not None:
                    raise error

    def error(self, op: str, seq: int) -> CollectiveMismatchError | CollectiveTimeoutError | None:
        """The mismatch seen so far at call ``seq`` (this rank's last announced), or one a peer
        found at an earlier call, or a call a peer gave up on ([Note: after a timeout]), or None.
        What is found is recorded ([Note: after a mismatch])."""
        if self.last is None or self.last[0] != seq or not self._peers:
            return None
        packed = self.last[1]
        at = self._offset + (seq % SLOTS) * SLOT_BYTES
        texts = {}
        for rank, view in self._peers.items():
            theirs = _read(view, at, seq)
            if theirs is not None and theirs != packed:
                words = _WORDS.unpack(theirs)
                if words[0] == _MARK:
                    return self._learned(rank, words[1], words[2], op, seq)
                if words[0] == _GAVE_UP:
                    return self._peer_gave_up(rank, words, op, seq)
                texts[rank] = describe_words(words)
        if not texts:
            return None
        texts[self._rank] = describe_words(_WORDS.unpack(packed))
        return self._record(op, seq, describe_mismatch(texts), "seen through this node's shared memory")

    def _learned(self, finder: int, op_code: int, seq: int, now_op: str,
                 now_seq: int) -> CollectiveMismatchError:
        """The mismatch at call ``seq`` that peer ``finder`` marked, found at call ``now_seq``."""
        op = OPS[op_code] if 0 <= op_code < len(OPS) else f"op#{op_code}"
        at = self._offset + (seq % SLOTS) * SLOT_BYTES
        texts = {}
        for rank, view in [(self._rank, self._own), *self._peers.items()]:
            theirs = _read(view, at, seq)
            if theirs is not None and _WORDS.unpack(theirs)[0] >= 0:  # not a mark
                texts[rank] = describe_words(_WORDS.unpack(theirs))
        text = (describe_mismatch(texts) if len(set(texts.values())) > 1
                else f"rank {finder} saw a call that differs from its own")
        return self._record(op, seq, text, f"rank {finder} found it through this node's shared memory, "
                                           f"this rank at {now_op}, sequence number {now_seq}")

    def _record(self, op: str, seq: int, text: str, how: str) -> CollectiveMismatchError:
        """Records the mismatch at call ``seq`` and marks this rank's slots for the calls after
        it ([Note: after a mismatch]); the first one recorded stands."""
        if self.mismatch is None:
            self.mismatch = (op, seq, text, how)
            mark = _WORDS.pack(_MARK, _OP_CODES.get(op, -1), seq, *(0,) * (_WORDS_COUNT - 3))
            for later in range(seq + 1, seq + SLOTS):
                at = self._offset + (later % SLOTS) * SLOT_BYTES
                _SEQ.pack_into(self._own, at, -1)
                self._own[at + 8:at + _FIELDS_END] = mark
                _SEQ.pack_into(self._own, at, later)
        return CollectiveMismatchError(op, seq, f"{text} ({how}; {_UNUSABLE})")

    def give_up(self, op: str, seq: int, missing: list[int] | None, timeout: float) -> None:
        """Records that this rank gave up on call ``seq`` at its timeout, ``missing`` ranks not
        having arrived (None: unknown), and marks its slots from that call on ([Note: after a
        timeout]); the first record stands."""
        if self.gave_up is not None or self.mismatch is not None:
            return
        self.gave_up = (op, seq, missing, timeout, None)
        masks = [0] * _MASK_WORDS
        if missing is None or any(r >= _MASK_WORDS * _MASK_BITS for r in missing):
            masks = [-1] * _MASK_WORDS
        else:
            for r in missing:
                masks[r // _MASK_BITS] |= 1 << (r % _MASK_BITS)
        mark = _WORDS.pack(_GAVE_UP, _OP_CODES.get(op, -1), seq, round(timeout * 1000), *masks)
        for call in range(seq, seq + SLOTS):
            at = self._offset + (call % SLOTS) * SLOT_BYTES
            _SEQ.pack_into(self._own, at, -1)
            self._own[at + 8:at + _FIELDS_END] = mark
            _SEQ.pack_into(self._own, at, call)

    def _peer_gave_up(self, who: int, words: tuple[int, ...], now_op: str,
                      now_seq: int) -> CollectiveTimeoutError:
        """The error for call ``now_seq`` once peer ``who`` has marked its slot for it after giving
        up on a call (``words``: the mark); recorded, so later calls are refused too."""
        op = OPS[words[1]] if 0 <= words[1] < len(OPS) else f"op#{words[1]}"
        masks = words[4:]
        missing = (None if masks[0] < 0 else
                   [i * _MASK_BITS + b for i, m in enumerate(masks) for b in range(_MASK_BITS) if m >> b & 1])
        if self.gave_up is None and self.mismatch is None:
            self.gave_up = (op, words[2], missing, words[3] / 1000, who)
        return gave_up_error(op, words[2], missing, words[3] / 1000, who, now_op, now_seq, self.world_ranks)

    def _refused(self, op: str, seq: int) -> CollectiveMismatchError:
        """What every call after a recorded mismatch raises instead of running."""
        first_op, first_seq, text, how = self.mismatch
        return CollectiveMismatchError(
            first_op, first_seq, f"{text} ({how}; {op}, sequence number {seq}, was not issued: {_UNUSABLE})")

    def close(self) -> None:
        peers, self._peers, self.last = self._peers, {}, None
        if self._owns_maps:
            for m in [self._own, *peers.values()]:
                close_map(m)


def create_shared(size: int, prefix: str) -> tuple[mmap.mmap, str]:
    """A new file of ``size`` zero bytes in /dev/shm (where it exists), mapped writable."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix=prefix, dir=directory)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size), path
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def open_shared(path: str, size: int) -> mmap.mmap:
    """A peer's file from ``create_shared``, mapped read-only."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)


def close_map(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:  # a view is still referenced somewhere; the GC unmaps it later
        pass


def node_id() -> str:
    """Names this machine (and boot), so that ranks can tell which peers share its memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@contextlib.contextmanager
def exchanged_maps(set_key: Callable[[str, str], None], get_key: Callable[[str], str | bytes], rank: int,
                   world_size: int, nbytes: int, prefix: str) -> Iterator[tuple[mmap.mmap, dict[int, mmap.mmap]]]:
    """This rank's new shared file of ``nbytes`` (mapped) and its same-node peers' (by rank), for
    a group whose members meet through a key-value store: publishes this rank's file as key
    ``str(rank)`` and maps the peers' (``get_key`` waits for a key to be set). The maps are closed
    if the block raises, else they are the block's to close; the file's name is removed when the
    block ends: end it only once every member has mapped it (after the group's construction
    barrier)."""
    own, path = create_shared(nbytes, prefix)
    peers: dict[int, mmap.mmap] = {}
    try:
        here = node_id()
        set_key(str(rank), f"{here}\n{path}")
        for peer in range(world_size):
            if peer != rank:
                value = get_key(str(peer))
                node, _, peer_path = (value.decode() if isinstance(value, bytes) else value).partition("\n")
                if node == here:
                    with contextlib.suppress(FileNotFoundError):  # the same name, another /dev/shm
                        peers[peer] = open_shared(peer_path, nbytes)
        yield own, peers
    except BaseException:
        for m in [own, *peers.values()]:
            close_map(m)
        raise
    finally:
        os.unlink(path)


@contextlib.contextmanager
def exchanged_slots(set_key: Callable[[str, str], None], get_key: Callable[[str], str | bytes], rank: int,
                    world_size: int) -> Iterator[CallSlots]:
    """Call slots for a group whose members meet through a key-value store (``exchanged_maps``)."""
    with exchanged_maps(set_key, get_key, rank, world_size, AREA_BYTES, "distframe-calls-") as (own, peers):
        yield CallSlots(own, peers, rank, owns_maps=True)


def _read(view: Any, at: int, seq: int) -> bytes | None:
    if _SEQ.unpack_from(view, at)[0] != seq:
        return None
    packed = view[at + 8:at + _FIELDS_END]
    return packed if _SEQ.unpack_from(view, at)[0] == seq else None
