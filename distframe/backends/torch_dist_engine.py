"""TorchDistributedBackend: the engine Gloo and NCCL share (see ``torch_dist`` for both).

Each (sub)group owns one torch.distributed process group object (``ProcessGroupGloo`` or
``ProcessGroupNCCL``), built directly on a key-value store under a prefix of its own, and its
methods are called directly: there is no global default group and no ``init_process_group``.
A subgroup's prefix is its parent's prefix plus the sequence number of the ``new_group`` call, so
every member derives the same one without talking, and only members build it (torch's own
``new_group`` needs every rank of the world, which does not fit nested groups).

[Note: what each call costs] A collective is one call of the process group's own operation on
the caller's tensor (or a zero-copy view of it), plus one dict assignment for the progress board
(see ``torch_dist_board``). Gloo waits in slices of ``WAIT_SLICE`` (0.2 s), asking between them
whether a peer has departed (``distframe.backends.departures``): a call that completes within
the first slice pays nothing for it. A reduce_scatter, whose Gloo wait cannot be sliced, is
watched by the board's thread instead (``torch_dist_waits``). Conversions happen only where the
transport lacks something: see ``torch_dist_wire``; floating MIN and MAX travel with a NaN flag
per element, twice the bytes (``nan_flags``, [Note: NaN flags]). ``debug=True`` adds, per
collective, the base class's all-gather of a 16 x int64 signature (128 bytes per rank: one
small-message latency), and per point-to-point message a 128-byte header that the receiver checks
before it posts the payload's receive.

[Note: point to point] ``send`` is buffered, as in the in-memory engine: the payload is copied
and posted, and ``send``/``isend`` return at once, so two ranks may both send before they
receive. Unfinished sends are kept alive and finished at ``shutdown``, which drops those to a
rank that left without receiving them (``departures``, [Note: sends to a rank that left];
``torch_dist_sends``). A message whose shape or dtype differs from the receive's never matches
it outside ``debug`` mode (a fingerprint of them and of the message's number is part of the tag:
``torch_dist_p2p``, [Note: the message's shape in its tag]), so the receive times out saying so;
one whose fingerprint is the receive's, which Gloo delivers, raises ``CollectiveMismatchError``
when its sender is on this node (it describes each message in shared memory: [Note: what a Gloo
receive checks]). With ``debug=True`` a mismatch raises ``CollectiveMismatchError`` naming both
at once. NCCL ignores tags: there a mismatched receive is not caught outside ``debug`` mode.
"""
from __future__ import annotations

import abc
import contextlib
import datetime
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from distframe.backends.base import DEFAULT_TIMEOUT, Call, CommunicationBackendBase
from distframe.backends.call_slots import exchanged_slots
from distframe.backends.composed import read_scatter_header, scatter_header, scattered_to
from distframe.backends.departures import Departure, in_world, send_departure_error
from distframe.backends.nan_flags import (ORDER_OPS, needs_nan_flags, pack_with_nan_flags,
                                          unpack_with_nan_flags)
from distframe.backends.reduction import reduce_into
from distframe.backends.signature import Signature
from distframe.backends.torch_dist_board import (WAIT_SLICE, ProgressBoard, _Shared, departures_key,
                                                 meet_in_store, peer_lost, wait_for_members)
from distframe.backends.torch_dist_options import (ALLREDUCE_OPTIONS, REDUCE_SCATTER_OPTIONS, TORCH_OPS,
                                                   options)
from distframe.backends.sent_messages import exchanged_sent_messages
from distframe.backends.torch_dist_debug_p2p import DebugPayloads
from distframe.backends.torch_dist_p2p import HEADER_TAG, RecvWork, debug_payload_tag, message_tag
from distframe.backends.torch_dist_sends import UnfinishedSends
from distframe.backends.torch_dist_waits import TorchDistWaits
from distframe.backends.torch_dist_wire import (NATIVE_DTYPES, from_reducible, movable, movable_flat,
                                                to_reducible)
from distframe.backends.types import CompletedWork, ReduceOp, Work
from distframe.errors import CollectiveTimeoutError, RankFailedError

_SCATTER_MAX_DIMS = 16
# What the post-first path reduces as it is (bool travels as uint8 on the general path).
_POSTABLE = NATIVE_DTYPES - {torch.bool}


class TorchDistributedBackend(TorchDistWaits, CommunicationBackendBase):
    """The engine shared by Gloo and NCCL; subclasses say how to build the process group and on
    which device its tensors live (``_device``). Tensors elsewhere are staged: copied to
    ``_device`` for the call and the results copied back to where the caller's tensors were.

    ``store`` is a torch.distributed store every rank of the group can reach, ``prefix`` the
    namespace of this group's keys in it (two groups on one store need different prefixes).
    """

    engine = "torch"
    _keeps_half_dtype = True
    _device: torch.device
    #: A wait that outlasts it asks whether a peer has departed (distframe.backends.departures).
    _wait_slice: datetime.timedelta = WAIT_SLICE

    def __init__(self, rank: int, world_size: int, store: dist.Store, *,
                 timeout: float = DEFAULT_TIMEOUT, debug: bool = False, prefix: str = "distframe",
                 _shared: _Shared | None = None) -> None:
        super().__init__(rank, world_size, timeout=timeout, debug=debug)
        self._owns_shared = _shared is None
        self._shared = _shared or _Shared(store, ProgressBoard(store, min(0.2, self.timeout / 10),
                                                               departures_key(prefix)))
        self._prefix = prefix
        self._progress_keys = {r: f"{prefix}/progress/{r}" for r in range(world_size)}
        self._my_progress_key = self._progress_keys[rank]
        self._peer_progress_keys = {r: k for r, k in self._progress_keys.items() if r != rank}
        self._p2p_counts = self._p2p_seq  # the base's message numbers; its departure announces the sends
        self._shared.board.register(self._my_progress_key, self._p2p_counts)
        timeout_delta = datetime.timedelta(seconds=self.timeout)
        store = lambda name: dist.PrefixStore(f"{prefix}/{name}/", self._shared.store)  # noqa: E731
        # The sent-message table: Gloo only, whose receives take only messages of their tag
        # ([Note: what a Gloo receive checks] in torch_dist_p2p); NCCL ignores tags.
        sent = (exchanged_sent_messages(store("sent").set, store("sent").get, rank, world_size)
                if self.engine == "gloo" else contextlib.nullcontext())
        with (exchanged_slots(store("slots").set, store("slots").get, rank, world_size) as self._slots,
              sent as self._sent_messages):
            self._pg = self._create_process_group(store("pg"), rank, world_size, timeout_delta)
            wait_for_members(store("ready"), rank, world_size, timeout_delta)  # every peer mapped ours
        self._sends = UnfinishedSends(waited=bool(self._wait_slice))
        self._debug_payloads = DebugPayloads()  # [Note: debug payloads in message order]
        self._shared.groups.add(self)
        # Holds no reference to this backend, or it would never run (shutdown cancels it).
        self._departs_when_gone = weakref.finalize(self, _collected, self._shared.board,
                                                   self._my_progress_key, self._sends)

    @property
    def has_failed(self) -> bool:
        """True once a call on this group or a sibling timed out or lost a peer, or ranks of this
        group called different things: the process groups are then in an unknown state and
        should be rebuilt."""
        return self._shared.failed or self._slots.mismatch is not None

    # ---- what subclasses provide -------------------------------------------------------------
    @abc.abstractmethod
    def _create_process_group(self, store: dist.Store, rank: int, world_size: int,
                              timeout: datetime.timedelta) -> Any: ...

    @abc.abstractmethod
    def _sibling_kwargs(self) -> dict[str, Any]:
        """Constructor arguments a subgroup inherits (the Gloo address, the NCCL device)."""

    # ---- collectives -------------------------------------------------------------------------
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, call: Call) -> None:
        self._arrive(call)
        staged = self._stage(tensor)
        self._reduce_in_place(staged, op, call, lambda wire, torch_op: self._pg.allreduce(
            [wire], options(dist.AllreduceOptions, reduceOp=torch_op)))
        self._unstage(staged, tensor)

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, call: Call) -> None:
        self._arrive(call)
        staged = self._stage(tensor)
        if self._rank != dst:  # the transport may use a non-root input as scratch space
            staged = staged.clone()
        self._reduce_in_place(staged, op, call, lambda wire, torch_op: self._pg.reduce(
            [wire], options(dist.ReduceOptions, rootRank=dst, reduceOp=torch_op)))
        if self._rank == dst:
            self._unstage(staged, tensor)

    def _reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp, call: Call,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        self._arrive(call)
        staged = self._stage(tensor)
        if needs_nan_flags(staged, op):
            return self._reduce_scatter_with_nan_flags(tensor, staged, op, call, out)
        plan = to_reducible(staged, op)
        if plan is None:
            return super()._reduce_scatter(tensor, op, call)
        wire, _ = plan
        if out is None or wire is not staged or staged is not tensor:  # else use the caller's buffer
            out = wire.new_empty((wire.shape[0] // self._world_size, *wire.shape[1:]))
        self._complete(call, self._pg._reduce_scatter_base, out, wire,
                       options(dist.ReduceScatterOptions, reduceOp=TORCH_OPS[op]))
        return self._result(from_reducible(out, tensor.dtype), tensor)

    def _reduce_scatter_with_nan_flags(self, tensor: torch.Tensor, staged: torch.Tensor, op: ReduceOp,
                                       call: Call, out: torch.Tensor | None) -> torch.Tensor:
        """Floating MIN/MAX: each rank's chunk travels with its NaN flags ([Note: NaN flags])."""
        packed = pack_with_nan_flags(staged, op, self._world_size).view(-1)
        share = packed.new_empty(packed.numel() // self._world_size)  # flat: Gloo divides dim 0
        self._complete(call, self._pg._reduce_scatter_base, share, packed,
                       options(dist.ReduceScatterOptions, reduceOp=TORCH_OPS[op]))
        if out is None or staged is not tensor:  # else write into the caller's buffer
            out = staged.new_empty((staged.shape[0] // self._world_size, *staged.shape[1:]))
        return self._result(unpack_with_nan_flags(share, out), tensor)

    def _all_gather(self, tensor: torch.Tensor, call: Call, out: torch.Tensor | None = None) -> torch.Tensor:
        self._arrive(call)
        staged = self._stage(tensor)
        if out is None or staged is not tensor:  # else gather straight into the caller's buffer
            out = staged.new_empty((self._world_size * staged.shape[0], *staged.shape[1:]))
        self._complete(call, self._pg._allgather_base, movable(out), movable(staged))
        return self._result(out, tensor)

    def _broadcast(self, tensor: torch.Tensor, src: int, call: Call) -> None:
        self._arrive(call)
        staged = self._stage(tensor)
        self._complete(call, self._pg.broadcast, [movable(staged)],
                       options(dist.BroadcastOptions, rootRank=src))
        self._unstage(staged, tensor)

    def _gather(self, tensor: torch.Tensor, dst: int, call: Call) -> list[torch.Tensor] | None:
        self._arrive(call)
        staged = self._stage(tensor)
        outs = [staged.new_empty(staged.shape) for _ in range(self._world_size)] if self._rank == dst else []
        self._complete(call, self._pg.gather, [[movable(o) for o in outs]] if outs else [],
                       [movable(staged)], options(dist.GatherOptions, rootRank=dst))
        return [self._result(o, tensor) for o in outs] if self._rank == dst else None

    def _scatter(self, chunks: list[torch.Tensor] | None, src: int, call: Call) -> torch.Tensor:
        self._arrive(call)
        # Only src knows the chunks' shape and dtype (and whether they live on the CPU).
        meta = scatter_header(chunks, _SCATTER_MAX_DIMS)
        self._broadcast(meta, src, call)
        shape, dtype, source_on_cpu = read_scatter_header(meta, src)
        out = torch.empty(shape, dtype=dtype, device=self._device)
        sources = [[movable(self._stage(c.contiguous())) for c in chunks]] if chunks is not None else []
        self._complete(call, self._pg.scatter, [movable(out)], sources,
                       options(dist.ScatterOptions, rootRank=src))
        return scattered_to(out, source_on_cpu)

    def _all_to_all(self, chunks: list[torch.Tensor], call: Call) -> list[torch.Tensor]:
        self._arrive(call)
        send_rows = [c.shape[0] for c in chunks]
        everyone = self._all_gather(torch.tensor(send_rows, dtype=torch.int64), call)
        recv_rows = everyone.view(self._world_size, self._world_size)[:, self._rank].tolist()
        send = self._stage(torch.cat(chunks))
        out = send.new_empty((sum(recv_rows), *send.shape[1:]))
        # Flat views with splits in elements: Gloo divides by dim 0, which may be 0 rows here.
        send_flat, per_row = movable_flat(send)
        out_flat, _ = movable_flat(out)
        self._complete(call, self._pg.alltoall_base, out_flat, send_flat,
                       [r * per_row for r in recv_rows], [r * per_row for r in send_rows],
                       dist.AllToAllOptions())
        return list(self._result(out, chunks[0]).split(recv_rows))

    def _barrier(self, call: Call) -> None:
        self._arrive(call)
        self._complete(call, self._pg.barrier, dist.BarrierOptions())

    def _new_group(self, ranks: list[int], call: Call) -> TorchDistributedBackend | None:
        self._arrive(call)
        if self._rank not in ranks:
            return None
        # Torch's rendezvous in the process group's constructor cannot be interrupted: members meet
        # in the store first, where a member that left without making this call is seen at once.
        members = {r: self._progress_keys[r] for r in ranks if r != self._rank}
        arrivals = dist.PrefixStore(f"{self._prefix}/group{call.seq}/arrived/", self._shared.store)
        missing = meet_in_store(arrivals, self._rank, ranks, self.timeout,
                                lambda s: self._departure_error(call.op, call.seq, s, peer_keys=members))
        if missing:
            self._shared.failed = True
            raise in_world(CollectiveTimeoutError(call.op, call.seq, missing, self.timeout,
                                                  "they never entered it"), self._world_ranks)
        try:
            return self._place_in_world(type(self)(
                ranks.index(self._rank), len(ranks), self._shared.store, timeout=self.timeout,
                debug=self.debug, prefix=f"{self._prefix}/group{call.seq}", _shared=self._shared,
                **self._sibling_kwargs()), ranks)
        except RuntimeError as exc:  # a member never came: the store's wait timed out
            error = self._comm_error(exc, call.op, call.seq, None)
            if error is None:
                raise
            raise error from exc

    # ---- point to point ----------------------------------------------------------------------
    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        seq = self._count_p2p("send", dst, tag)
        payload = tensor.to(self._device, copy=True)  # buffered: the caller may reuse `tensor`
        if self.debug:
            header = Signature("send", tuple(tensor.shape), tensor.dtype).encode(seq).to(self._device)
            self._sends.add((self._pg.send([header], dst, tag + HEADER_TAG), header, dst, tag, seq))
            wire_tag = debug_payload_tag(tag, seq)
        else:  # [Note: the message's shape in its tag] (torch_dist_p2p)
            wire_tag = message_tag(tag, tensor, seq)
            if self._sent_messages is not None:  # described before it is sent (sent_messages)
                self._sent_messages.record(dst, tag, seq, tensor, wire_tag)
        try:
            work = self._pg.send([movable(payload)], dst, wire_tag)
        except RuntimeError as exc:
            raise self._send_failed(exc, dst, tag, seq) from None
        self._sends.add((work, payload, dst, tag, seq))
        return CompletedWork(None)

    def _send_failed(self, exc: RuntimeError, dst: int, tag: int, seq: int) -> Exception:
        """What a send whose post raised ``exc`` raises: the departure of ``dst`` if it left, else,
        for a closed connection, RankFailedError naming it (Gloo's message blames a crash)."""
        if not peer_lost(exc):
            return exc
        self._shared.failed = True
        left = send_departure_error(self.departures().get(dst), dst, self._rank, tag, seq, 0.0)
        return in_world(left, self._world_ranks) or RankFailedError(
            dst, f"send (message {seq} with tag {tag} to rank {dst}): {self.engine} found the connection "
                 f"to rank {dst} closed: that rank gave up on a call at its timeout (which closes its "
                 "group's connections) or it died; the group is unusable now, shut it down")

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        return RecvWork(self, tensor, src, tag, self._count_p2p("recv", src, tag))

    def _count_p2p(self, direction: str, peer: int, tag: int) -> int:
        return self._next_p2p_seq(direction, peer, tag)

    # ---- life cycle --------------------------------------------------------------------------
    def depart(self, *, failed: bool = False) -> None:
        """Tells the peers that this rank makes no further call on this group or on the groups
        made from it (its function has returned, or raised when ``failed``): a peer waiting for it
        in a call it has not issued stops at once (``distframe.backends.departures``).
        ``shutdown`` departs; launchers depart for a rank whose function has ended."""
        under = f"{self._prefix}/"  # this group's keys and those of the groups made from it
        issued = {g._my_progress_key: g._seq for g in list(self._shared.groups)
                  if g._my_progress_key.startswith(under)}
        self._shared.board.depart(under, issued, failed)  # with the sends register() handed it

    def departures(self) -> dict[int, Departure]:
        """The peers that have departed (one store round trip while none has)."""
        return self._shared.board.departures(self._peer_progress_keys) or {}

    def _shutdown(self) -> None:
        self._departs_when_gone.detach()
        self.depart()
        self._sends.finish(self._rank, self.timeout, self.departures)
        self._pg = None
        self._slots.close()
        if self._sent_messages is not None:
            self._sent_messages.close()
        if self._owns_shared:
            self._shared.board.close()

    # ---- shared machinery --------------------------------------------------------------------
    def _arrive(self, call: Call) -> None:
        self._shared.board.reached(self._my_progress_key, call.seq)

    def _stage(self, tensor: torch.Tensor) -> torch.Tensor:
        # is_cpu first: comparing devices builds torch.device objects, a cost on every call.
        if tensor.is_cpu and self._device.type == "cpu":
            return tensor
        return tensor if tensor.device == self._device else tensor.to(self._device)

    @staticmethod
    def _unstage(staged: torch.Tensor, tensor: torch.Tensor) -> None:
        if staged is not tensor:
            tensor.copy_(staged)

    @staticmethod
    def _result(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if out.is_cpu and like.is_cpu:
            return out
        return out if out.device == like.device else out.to(like.device)

    def _reduce_in_place(self, staged: torch.Tensor, op: ReduceOp, call: Call,
                         issue: Callable[[torch.Tensor, dist.ReduceOp], Any]) -> None:
        if needs_nan_flags(staged, op):  # the values travel with their NaN flags ([Note: NaN flags])
            packed = pack_with_nan_flags(staged, op)
            self._complete(call, issue, packed, TORCH_OPS[op])
            unpack_with_nan_flags(packed, staged)
            return
        plan = to_reducible(staged, op)
        if plan is None:  # e.g. complex PRODUCT: gather everything, reduce here in rank order
            everyone = self._all_gather(staged.reshape(1, staged.numel()), call)
            reduced = reduce_into(torch.empty_like(staged).reshape(-1), list(everyone.unbind(0)), op)
            staged.copy_(reduced.view(staged.shape))
            return
        wire, shares_memory = plan
        self._complete(call, issue, wire, TORCH_OPS[op])
        if not shares_memory:
            staged.copy_(from_reducible(wire, staged.dtype))

    # ---- post first (see distframe.backends.posted; Gloo only): native dtypes ------------------
    # Floating MIN/MAX is not posted: it goes with its NaN flags (nan_flags), on the general path.
    def _post_all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Any:
        if tensor.dtype in _POSTABLE and not (op in ORDER_OPS and tensor.is_floating_point()):
            return self._pg.allreduce([tensor], ALLREDUCE_OPTIONS[op])
        return None

    def _post_all_gather(self, tensor: torch.Tensor, out: torch.Tensor) -> Any:
        if out.is_cpu:
            return self._pg._allgather_base(movable(out), movable(tensor))
        return None

    def _post_reduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor, op: ReduceOp) -> Any:
        if out.is_cpu and tensor.dtype in _POSTABLE and not (op in ORDER_OPS and tensor.is_floating_point()):
            return self._pg._reduce_scatter_base(out, tensor, REDUCE_SCATTER_OPTIONS[op])
        return None

    def _wait_posted(self, op: str, seq: int, handle: Any) -> None:
        self._shared.board.reached(self._my_progress_key, seq)
        self._await(handle, op, seq)


def _collected(board: ProgressBoard, progress_key: str, sends: UnfinishedSends) -> None:
    """A backend that is garbage, or alive when the interpreter exits, makes no further call: it
    departs after the last call it entered, and its sends' thread ends once they have completed,
    letting go of the process group and its sockets (the board's ends with ``_Shared``)."""
    board.depart(progress_key, {}, False)
    sends.close()
