"""MPICommunicationBackend: the engine for processes started by mpiexec, over mpi4py.

Every collective maps onto its native non-blocking MPI call (Iallreduce, Iallgather,
Ireduce_scatter_block, Ibcast, Ireduce, Igather, Iscatter, Ialltoallv, Ibarrier) on zero-copy
NumPy views of the tensors (see ``mpi_buffers``), and is polled until it completes or the
backend's timeout passes (see ``mpi_progress``); a timeout raises ``CollectiveTimeoutError``
naming the ranks that never entered the call, and a peer on this node that has departed without
issuing the call (its function returned or raised, or it shut the backend down) stops the wait at
once (``distframe.backends.departures``). Point-to-point uses Isend/Irecv of the tensor's
bytes (``mpi_p2p``): a receive whose message has another size raises ``CollectiveMismatchError``,
and so does one of the same size in another shape or dtype from a rank on this node (through
shared memory, ``mpi_messages``) or, with ``debug=True``, from any rank ([Note: what a receive
checks]); a wait for a receive whose sender,
or a send whose receiver, left without sending or receiving the message stops at once
(``departures``, [Note: sends to a rank that left]).

With ``debug=True`` the base class all-gathers a 16-integer signature before each collective, so
ranks that disagree on op, shape, dtype or arguments all raise ``CollectiveMismatchError``, for
one small-message latency per call (128 bytes per rank; a few microseconds on one node).

[Note: after a timeout] A timed-out MPI request cannot be cancelled. It stays referenced by the
backend (with its buffers) and may still complete if the late rank arrives, so a group that has
timed out is not fit for further collectives: shut it down and build a new one. ``shutdown``
keeps the communicator while a request is left pending, and never synchronises with peers: it
frees the communicator once every peer has shut it down too and nothing sent on it was left
unreceived ([Note: freeing a communicator] in ``mpi_retire``).

[Note: calls a peer never made] A rank that only sends in a rooted collective (the root of a
broadcast or scatter, a non-root of a reduce or gather, a rank at the edge of MPI's tree) completes
its part at once, as MPI sends small messages eagerly, even if a peer never makes the call; the
other engines raise there. So after such a call (``_confirm_rooted``) the rank reads its peers'
progress: if a peer that has left without making the call is already seen, the call raises what
a wait would have; if some peer has not yet been seen making it, the call is noted
(``calls_not_seen_made``) and ``MPIPool`` compares every rank's notes and call counts when the
run ends (``departures.skipped_call_errors``). The collectives that every rank must join
(all_reduce, all_gather, ...) never complete without every peer and pay nothing for this.
Not covered: a rank started by mpiexec directly (``init_backend``) whose peer leaves after its
call completed, subgroups' calls under ``MPIPool`` (only the run's own group is compared), and
peers on other nodes, whose progress and departures are not seen (MPIPool's ranks share a node).
"""
from __future__ import annotations

import time
import weakref
from collections import deque
from typing import Any

import torch

from distframe.backends.base import DEFAULT_TIMEOUT, Call, CommunicationBackendBase
from distframe.backends.composed import read_scatter_header, scatter_header, scattered_to
from distframe.backends.departures import (Departure, departure_error, in_world, subgroup_world_ranks,
                                           world_note)
from distframe.backends.mpi_buffers import (AddressWire, device_aware, displacements, import_mpi, mpi_ops,
                                            needs_staging, stage_back, stage_in,
                                            upcast_for_mpi, wire, write_back)
from distframe.backends.mpi_p2p import P2PWork, irecv_with_header, isend_with_header
from distframe.backends.mpi_progress import ProgressBoard, missing_ranks, wait_request
from distframe.backends.mpi_retire import free_retired, retire, retire_later
from distframe.backends.types import ReduceOp, Work
from distframe.backends.validation import is_dense
from distframe.errors import CollectiveTimeoutError

_MAX_SCATTER_DIMS = 32
# Calls not yet seen made by every peer ([Note: calls a peer never made]); those seen made since are
# dropped, so the bound (the newest kept) matters only to a rank making over a thousand rooted
# calls after a peer stopped: the launcher reports the first call a peer skipped.
_MAX_NOTED_CALLS = 1024
# What the post-first path reduces as it is: not float16/bfloat16 (reduced in float32) or bool
# (moved as bytes; the base class turns its SUM and PRODUCT into MAX and MIN).
_POSTABLE = frozenset({torch.float64, torch.float32, torch.int64, torch.int32, torch.int16, torch.int8,
                       torch.uint8})


class MPICommunicationBackend(CommunicationBackendBase):
    """One MPI process of a group. ``comm`` defaults to a duplicate of ``MPI.COMM_WORLD`` (a
    communicator passed in is duplicated too, so the engine's traffic never meets the caller's).
    Building one is collective over the communicator.

    Collectives run as described in ``ICommunicationBackend``; each rank holds exactly what the
    in-memory engine would give it. ``timeout`` (seconds) bounds every wait inside MPI."""

    engine = "mpi"
    _posts_first = True

    def __init__(self, comm: Any = None, *, timeout: float = DEFAULT_TIMEOUT, debug: bool = False) -> None:
        MPI = import_mpi()
        free_retired()  # communicators shut down earlier whose context ids can go back
        own = (MPI.COMM_WORLD if comm is None else comm).Dup()
        self._setup(MPI, own, timeout, debug)

    @classmethod
    def _adopt(cls, comm: Any, MPI: Any, timeout: float, debug: bool,
               world_ranks: list[int] | None) -> MPICommunicationBackend:
        """A backend over a communicator this engine created (a subgroup; ``world_ranks``: the
        world rank of each of its ranks, None where the same); it takes ownership."""
        backend = cls.__new__(cls)
        backend._setup(MPI, comm, timeout, debug, world_ranks)
        return backend

    def _setup(self, MPI: Any, comm: Any, timeout: float, debug: bool,
               world_ranks: list[int] | None = None) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size(), timeout=timeout, debug=debug)
        self._MPI = MPI
        self._comm = comm
        self._device_aware = device_aware(MPI)
        ops = mpi_ops(MPI)  # by op and whether the dtype is floating: [Note: NaN in MPI's MIN and MAX]
        self._op = lambda op, tensor: ops[op, tensor.is_floating_point()]
        self._address = AddressWire(MPI)
        self._board = ProgressBoard(comm, MPI)
        self._slots = self._board.slots
        # The world rank of each rank here, None for the world: [Note: ranks of the world] in departures
        self._world_ranks = self._slots.world_ranks = world_ranks
        # Requests that timed out, with the buffers MPI may still write: never freed.
        self._abandoned: list[tuple[Any, Any]] = []
        self._subgroups: weakref.WeakSet[MPICommunicationBackend] = weakref.WeakSet()
        self._not_seen_made: deque[tuple[int, str]] = deque(maxlen=_MAX_NOTED_CALLS)
        # A backend that is garbage (a group made inside a function that has returned, say) can
        # make no further call: it departs, even if shutdown() never ran, and its communicator is
        # retired as shutdown would.
        self._finalizer = weakref.finalize(self, _collected, self._board, comm, MPI, self._p2p_seq,
                                           self._abandoned)

    @property
    def comm(self) -> Any:
        """The engine's own MPI communicator (for inspection; do not issue calls on it)."""
        return self._comm

    # ---- waiting -------------------------------------------------------------------------------
    def _complete(self, call: Call, start, keep: Any) -> None:
        """Publishes the call's sequence number, starts the request and waits for it."""
        self._board.publish(call.seq)
        self._wait(call, start(), keep)

    def _wait(self, call: Call, request: Any, keep: Any) -> None:
        """Waits for ``request``, started after publishing ``call.seq`` (the hot collectives do
        both inline, saving a closure per call); ``keep`` is what MPI may still touch on timeout."""
        if not request.Test():
            wait_request(request, time.monotonic() + call.timeout,
                         lambda waited, timed_out: self._stuck(call, request, keep, waited, timed_out))

    def _confirm_rooted(self, call: Call) -> None:
        """After a rooted call has completed here, which it may have without some peer: raises if a
        peer is seen to have left without making it, else notes it until every peer is seen
        making it ([Note: calls a peer never made])."""
        seen = self._board.read()
        floor = min(seen.values()) if len(seen) == self._world_size else None
        if floor is not None and floor >= call.seq:
            return
        gone = {rank: d for rank, d in self._board.departures().items() if d.issued < call.seq}
        if gone:
            raise in_world(departure_error(gone, call.op, call.seq, 0.0), self._world_ranks)
        noted = self._not_seen_made
        while floor is not None and noted and noted[0][0] <= floor:
            noted.popleft()  # every peer has made it since
        noted.append((call.seq, call.op))

    def calls_not_seen_made(self) -> tuple[int, list[tuple[int, str]]]:
        """How many calls this rank has issued on this group, and (sequence number, op) of the
        rooted calls that completed here before it saw every peer make them (the newest
        ``_MAX_NOTED_CALLS``), for the launcher to compare when the run ends."""
        return self._seq, list(self._not_seen_made)

    def _missing_ranks(self, seq: int) -> list[int] | None:
        missing, unknown = missing_ranks(self._board.read(), seq, self._world_size)
        return None if unknown else missing  # ranks on other nodes may be missing too

    def _stuck(self, call: Call, request: Any, keep: Any, waited: float,
               timed_out: bool) -> BaseException | None:
        """The error that ends a wait for ``request`` (see ``wait_request``), if any."""
        error = self._slots.error(call.op, call.seq)  # a peer on this node called something else
        if error is not None:
            self._abandoned.append((request, keep))
            return error
        if timed_out:
            return self._timed_out(call, request, keep)
        error = departure_error(self._board.departures(), call.op, call.seq, waited)
        if error is not None:
            self._abandoned.append((request, keep))
        return in_world(error, self._world_ranks)

    def _timed_out(self, call: Call, request: Any, keep: Any) -> CollectiveTimeoutError:
        self._abandoned.append((request, keep))
        missing, unknown = missing_ranks(self._board.read(), call.seq, self._world_size)
        if missing:
            detail = "they have not entered this call"
        elif unknown:
            detail = "every rank on this node arrived"
        else:
            detail = ("every rank entered this call but it did not complete: a rank may be stuck "
                      "or ranks passed different sizes (debug=True checks)")
        if unknown:
            detail += f"; the progress of ranks {unknown} (other nodes) cannot be read"
        detail += "; this group is unusable now, shut it down"
        self._slots.give_up(call.op, call.seq, missing, call.timeout)  # peers stop at once too
        return CollectiveTimeoutError(call.op, call.seq, missing, call.timeout,
                                      world_note(missing, self._world_ranks) + detail)

    # ---- post first (see distframe.backends.posted): dtypes MPI reduces as they are -----------
    def _post_all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Any:
        if tensor.dtype in _POSTABLE:
            request = self._comm.Iallreduce(self._MPI.IN_PLACE, self._address(tensor), self._op(op, tensor))
            return request, tensor
        return None

    def _post_all_gather(self, tensor: torch.Tensor, out: torch.Tensor) -> Any:
        if out.is_cpu:
            return self._comm.Iallgather(self._address(tensor), self._address(out)), (tensor, out)
        return None

    def _post_reduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor, op: ReduceOp) -> Any:
        if out.is_cpu and tensor.dtype in _POSTABLE:
            return (self._comm.Ireduce_scatter_block(self._address(tensor), self._address(out),
                                                     self._op(op, tensor)), (tensor, out))
        return None

    def _wait_posted(self, op: str, seq: int, handle: Any) -> None:
        request, keep = handle
        self._board.publish(seq)
        if not request.Test():
            wait_request(request, time.monotonic() + self.timeout, lambda waited, timed_out: self._stuck(
                Call(op, seq, None, self.timeout), request, keep, waited, timed_out))

    # ---- collectives ---------------------------------------------------------------------------
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, call: Call) -> None:
        stage = needs_staging(tensor, self._device_aware)
        host = stage_in(tensor, stage)
        work = upcast_for_mpi(host)
        self._board.publish(call.seq)
        request = self._comm.Iallreduce(self._MPI.IN_PLACE, self._address(work), self._op(op, work))
        self._wait(call, request, work)
        write_back(host, work)
        write_back(tensor, host)

    def _all_gather(self, tensor: torch.Tensor, call: Call, out: torch.Tensor | None = None) -> torch.Tensor:
        stage = needs_staging(tensor, self._device_aware)
        host = stage_in(tensor, stage)
        if stage or out is None:  # a caller's buffer is used directly when no staging is needed
            out = host.new_empty((self._world_size * host.shape[0], *host.shape[1:]))
        self._board.publish(call.seq)
        self._wait(call, self._comm.Iallgather(self._address(host), self._address(out)), (host, out))
        return stage_back(out, tensor, stage)

    def _reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp, call: Call,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        stage = needs_staging(tensor, self._device_aware)
        work = upcast_for_mpi(stage_in(tensor, stage))
        if stage or out is None or out.dtype != work.dtype:  # else reduce straight into the caller's buffer
            out = work.new_empty((work.shape[0] // self._world_size, *work.shape[1:]))
        self._board.publish(call.seq)
        self._wait(call, self._comm.Ireduce_scatter_block(self._address(work), self._address(out),
                                                          self._op(op, work)), (work, out))
        if out.dtype != tensor.dtype:
            out = out.to(tensor.dtype)
        return stage_back(out, tensor, stage)

    def _broadcast(self, tensor: torch.Tensor, src: int, call: Call) -> None:
        stage = needs_staging(tensor, self._device_aware)
        host = stage_in(tensor, stage)
        buf = wire(host)
        self._complete(call, lambda: self._comm.Ibcast(buf, root=src), buf)
        self._confirm_rooted(call)
        write_back(tensor, host)

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, call: Call) -> None:
        stage = needs_staging(tensor, self._device_aware)
        host = stage_in(tensor, stage)
        work = upcast_for_mpi(host)
        buf = wire(work)
        root = self._rank == dst
        send = self._MPI.IN_PLACE if root else buf
        self._complete(call, lambda: self._comm.Ireduce(
            send, buf if root else None, self._op(op, work), root=dst), buf)
        self._confirm_rooted(call)
        if root:
            write_back(host, work)
            write_back(tensor, host)

    def _gather(self, tensor: torch.Tensor, dst: int, call: Call) -> list[torch.Tensor] | None:
        stage = needs_staging(tensor, self._device_aware)
        host = stage_in(tensor, stage)
        out = host.new_empty((self._world_size, *host.shape)) if self._rank == dst else None
        send, recv = wire(host), None if out is None else wire(out)
        self._complete(call, lambda: self._comm.Igather(send, recv, root=dst), (send, recv))
        self._confirm_rooted(call)
        return None if out is None else list(stage_back(out, tensor, stage).unbind(0))

    def _scatter(self, chunks: list[torch.Tensor] | None, src: int, call: Call) -> torch.Tensor:
        # Only src knows the chunks' shape, dtype and device kind: broadcast them first.
        meta = scatter_header(chunks, _MAX_SCATTER_DIMS)
        meta_buf = wire(meta)
        self._complete(call, lambda: self._comm.Ibcast(meta_buf, root=src), meta_buf)
        shape, dtype, source_on_cpu = read_scatter_header(meta, src)
        full = None if chunks is None else torch.stack(
            [c.to("cpu") if needs_staging(c, self._device_aware) else c for c in chunks])
        device = full.device if full is not None else "cpu"
        out = torch.empty(shape, dtype=dtype, device=device)
        send, recv = (None if full is None else wire(full)), wire(out)
        self._complete(call, lambda: self._comm.Iscatter(send, recv, root=src), (send, recv))
        self._confirm_rooted(call)
        return scattered_to(out, source_on_cpu)

    def _all_to_all(self, chunks: list[torch.Tensor], call: Call) -> list[torch.Tensor]:
        stage = any(needs_staging(c, self._device_aware) for c in chunks)
        host = [stage_in(c, stage) for c in chunks]
        trailing = tuple(host[0].shape[1:])
        per_row = torch.Size(trailing).numel()  # 1 for 1-dim chunks, 0 for rows of no elements
        send_rows = torch.tensor([c.shape[0] for c in host], dtype=torch.int64)
        recv_rows = torch.empty_like(send_rows)
        send_meta, recv_meta = wire(send_rows), wire(recv_rows)
        self._complete(call, lambda: self._comm.Ialltoall(send_meta, recv_meta), (send_meta, recv_meta))
        send_counts = (send_rows * per_row).tolist()
        recv_counts = (recv_rows * per_row).tolist()
        flat_in = torch.cat([c.reshape(-1) for c in host])
        flat_out = flat_in.new_empty(sum(recv_counts))
        send = [wire(flat_in), (send_counts, displacements(send_counts))]
        recv = [wire(flat_out), (recv_counts, displacements(recv_counts))]
        self._complete(call, lambda: self._comm.Ialltoallv(send, recv), (send, recv))
        parts = flat_out.split(recv_counts)
        return [stage_back(p.view(int(n), *trailing), chunks[0], stage)
                for p, n in zip(parts, recv_rows.tolist())]

    def _barrier(self, call: Call) -> None:
        self._complete(call, self._comm.Ibarrier, None)

    def _new_group(self, ranks: list[int], call: Call) -> MPICommunicationBackend | None:
        # Comm.Split has no non-blocking form: an Ibarrier first bounds the wait for late ranks,
        # after which Split only meets ranks that are already there. Twice: a rank whose first one
        # timed out has left, but its abandoned request still completes a late rank's first one,
        # which then entered Split alone and hung; its second one times out instead.
        self._complete(call, self._comm.Ibarrier, None)
        self._complete(call, self._comm.Ibarrier, None)
        member = self._rank in ranks
        free_retired()
        sub = self._comm.Split(0 if member else self._MPI.UNDEFINED,
                               ranks.index(self._rank) if member else 0)
        if not member:
            return None
        group = type(self)._adopt(sub, self._MPI, self.timeout, self.debug,
                                  subgroup_world_ranks(self._world_ranks, ranks))
        self._subgroups.add(group)  # it departs with this backend
        return group

    # ---- point to point ------------------------------------------------------------------------
    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        seq = self._next_p2p_seq("send", dst, tag)
        if self.debug:  # a header first ([Note: what a receive checks] in mpi_p2p)
            return isend_with_header(self, tensor, dst, tag, seq)
        host = stage_in(tensor, needs_staging(tensor, self._device_aware))
        self._board.sent.record(dst, tag, seq, tensor)  # before it is sent (mpi_messages)
        return P2PWork(self, self._comm.Isend([wire(host), self._MPI.BYTE], dst, tag), "send", seq, dst, tag,
                       host)

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        seq = self._next_p2p_seq("recv", src, tag)
        if self.debug:
            return irecv_with_header(self, tensor, src, tag, seq)
        stage = needs_staging(tensor, self._device_aware)
        host = tensor
        if stage or not is_dense(tensor):  # receive into a buffer, copied over on completion
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu" if stage else tensor.device)
        return P2PWork(self, self._comm.Irecv([wire(host), self._MPI.BYTE], src, tag), "recv", seq, src, tag,
                       host, target=tensor)

    def depart(self, *, failed: bool = False) -> None:
        """Tells the peers on this node that this rank makes no further call on this group or on
        the groups made from it (its function has returned, or raised when ``failed``): a peer
        waiting for it in a call it has not issued stops at once (``distframe.backends.departures``).
        ``shutdown`` departs; the first departure stands."""
        self._board.depart(self._seq, failed, self._p2p_seq)
        for group in list(self._subgroups):
            group.depart(failed=failed)

    def departures(self) -> dict[int, Departure]:
        """The peers on this node that have departed, with the messages each had sent."""
        return self._board.departures()

    def _shutdown(self) -> None:
        self._finalizer.detach()
        self.depart()
        self._board.close()
        # Only a request given up on that is still pending keeps the communicator for good, with
        # its buffers, which MPI may still write after this backend is gone. Otherwise it is
        # freed once the peers' counts show nothing can outlive it
        # ([Note: freeing a communicator] in mpi_retire).
        retire(self._comm, self._MPI, self._seq, dict(self._p2p_seq), self._abandoned)


def _collected(board: ProgressBoard, comm: Any, MPI: Any, p2p_counts: dict[tuple[str, int, int], int],
               abandoned: list[Any]) -> None:
    """A backend that was garbage collected without ``shutdown()``: it departs after the last call
    it entered, and its communicator is retired at the next one this process builds."""
    issued = board.last_entered()
    board.depart_after_entered(p2p_counts)
    board.close()
    retire_later(comm, MPI, issued, dict(p2p_counts), abandoned)
