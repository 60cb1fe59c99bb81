"""CommunicationBackendBase: what the four engines share.

The public methods here validate arguments, number the call (a per-group sequence number),
count it in ``stats``, optionally check in ``debug`` mode that every rank makes the same call,
and run it now or on the backend's communication thread (``async_op=True``). Engines implement the
``_raw`` methods below on already validated, contiguous tensors; a raw method an engine does not
override is composed from the ones it has (``composed.py``; for example ``reduce`` from ``all_reduce``).

[Note: ordering] Collectives must be issued in the same order on every rank. Asynchronous calls
run one at a time, in issue order, on a single communication thread; a synchronous call first
waits for every asynchronous call issued before it. So the order the engine sees is the order the
user wrote, whichever thread runs it (``async_calls.py``, which also says what happens after an
asynchronous call fails).
"""
from __future__ import annotations

import abc
import contextlib
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from distframe.backends import validation
from distframe.backends.async_calls import AsyncCalls
from distframe.backends.composed import RESERVED_TAG, Call, ComposedCollectives
from distframe.backends.departures import Departure
from distframe.backends.posted import PostedCollectives
from distframe.backends.reduction import LOW_PRECISION, average_, work_tensor, copy_result
from distframe.backends.signature import Signature
from distframe.backends.types import CommStats, ReduceOp, Work, effective_op

DEFAULT_TIMEOUT = 300.0


class CommunicationBackendBase(ComposedCollectives, PostedCollectives, AsyncCalls, abc.ABC):
    """Shared life cycle of the engines. See ``ICommunicationBackend`` for the contract.

    ``timeout`` (seconds) bounds every blocking wait; ``debug=True`` makes engines that cannot see
    their peers' arguments (MPI, Gloo, NCCL) exchange a 16-integer signature before each
    collective, so a mismatch raises ``CollectiveMismatchError`` on every rank instead of giving a
    wrong answer or hanging. The in-memory engine always checks; the others always compare the
    ranks of one node (``call_slots``).
    """

    engine: str = "base"
    #: AVG of float16/bfloat16 moves the tensor's own dtype (see ``reduction.work_tensor``).
    _keeps_half_dtype = False

    def __init__(self, rank: int, world_size: int, *, timeout: float = DEFAULT_TIMEOUT,
                 debug: bool = False) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of world_size {world_size}")
        self.timeout = validation.check_timeout(timeout)
        self._rank = rank
        self._world_size = world_size
        self.debug = debug
        self.stats = CommStats()
        self._seq = 0
        self._closed = False
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._async_failure: str | None = None
        self._p2p_seq: dict[tuple[str, int, int], int] = {}
        self._groups_made: weakref.WeakSet[CommunicationBackendBase] = weakref.WeakSet()

    # ---- identity and life cycle -------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self._rank}, world_size={self._world_size})"

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        # With an exception leaving the block, that one is the one to see.
        with contextlib.suppress(Exception) if exc_type is not None else contextlib.nullcontext():
            self.shutdown()

    def shutdown(self) -> None:
        """Waits for pending asynchronous work, then releases the engine's resources. Idempotent.
        Raises the first failure of an asynchronous call whose ``Work`` was never waited for (or
        whose wait did not see it), after releasing everything: such a call did not happen on
        every rank, and saying nothing let a run whose ranks made different calls end as a
        success. The groups made from this one (``new_group``, nested too) are shut down first, as
        torch's ``destroy_process_group`` ends every group."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            executor, self._executor = self._executor, None
        failures = []
        for group in list(self._groups_made):
            try:
                group.shutdown()
            except BaseException as exc:  # noqa: BLE001 - this group still shuts down; raised below
                failures.append(exc)
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=False)
        self._shutdown()
        with self._lock:
            pending, self._pending = self._pending, []
        failures += [f.exception() for f in pending if not f.cancelled() and f.exception() is not None]
        if failures:
            raise failures[0]

    @property
    def is_shut_down(self) -> bool:
        return self._closed

    def departures(self) -> dict[int, Departure]:
        """The peers known to have left this group (``distframe.backends.departures``), by rank;
        empty where the engine cannot tell."""
        return {}

    def peers_sharing_autograd_thread(self) -> list[int]:
        """The peers (ranks of this group) whose backward runs on the calling thread, so that
        a wait here for them can never end: in-memory ranks sharing a GPU, asked on that GPU's
        autograd thread. Empty on every other engine and thread."""
        return []

    # ---- collectives -----------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, *,
                   async_op: bool = False) -> torch.Tensor | Work:
        """Reduces ``tensor`` across ranks, in place on every rank; returns it."""
        op = op if op.__class__ is ReduceOp else ReduceOp.parse(op)
        data = self._check_tensor("all_reduce", tensor, written=True)
        applied = effective_op(op, tensor.dtype)
        if self._may_post(async_op) and data.is_cpu and validation.is_dense(data) and not (
                applied is ReduceOp.AVG and data.dtype in LOW_PRECISION) and self._posted(
                "all_reduce", data.nbytes, (tensor.shape, tensor.dtype, (("op", op.name),)),
                self._post_all_reduce, data,
                ReduceOp.SUM if applied is ReduceOp.AVG else applied):
            if applied is ReduceOp.AVG:
                data.div_(self._world_size)
            return tensor
        sig = lambda: Signature("all_reduce", tuple(tensor.shape), tensor.dtype, (("op", op.name),))

        def run(call: Call) -> torch.Tensor:
            work = work_tensor(data, applied, self._world_size, self._keeps_half_dtype)
            self._all_reduce(work, ReduceOp.SUM if applied is ReduceOp.AVG else applied, call)
            if applied is ReduceOp.AVG:
                average_(work, self._world_size, self._keeps_half_dtype)
            if work is not data:
                copy_result(data, work)
            return tensor
        return self._run("all_reduce", sig, tensor.nbytes, run, async_op)

    def all_gather(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None,
                   async_op: bool = False) -> torch.Tensor | Work:
        """Concatenation of every rank's ``tensor`` along dim 0 in rank order (a 0-dim tensor
        counts as shape (1,)). Every rank must pass the same shape. ``out`` (optional, contiguous,
        not overlapping ``tensor``) receives the result, saving an allocation per call."""
        data = self._check_tensor("all_gather", tensor)
        flat = validation.dense(data.reshape(1) if data.dim() == 0 else data)
        shape = (self._world_size * flat.shape[0], *flat.shape[1:])
        if out is not None:
            out = self._check_out("all_gather", out, shape, tensor)
        if self._may_post(async_op) and flat.is_cpu:
            result = out if out is not None else flat.new_empty(shape)
            if self._posted("all_gather", tensor.nbytes, (tensor.shape, tensor.dtype, ()),
                            self._post_all_gather, flat, result):
                return result
        sig = lambda: Signature("all_gather", tuple(tensor.shape), tensor.dtype)
        return self._run("all_gather", sig, tensor.nbytes,
                         lambda call: _into(out, self._all_gather(flat, call, out)), async_op)

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, *,
                       out: torch.Tensor | None = None, async_op: bool = False) -> torch.Tensor | Work:
        """Reduces ``tensor`` across ranks and returns chunk ``rank`` of dim 0 (in ``out`` if given:
        contiguous, not overlapping ``tensor``)."""
        op = op if op.__class__ is ReduceOp else ReduceOp.parse(op)
        data = self._check_tensor("reduce_scatter", tensor)
        if tensor.dim() == 0 or tensor.shape[0] % self._world_size:
            raise ValueError(
                f"reduce_scatter needs dim 0 divisible by the world size {self._world_size}, got "
                f"shape {tuple(tensor.shape)}; pad dim 0 to a multiple of {self._world_size}")
        shape = (tensor.shape[0] // self._world_size, *tensor.shape[1:])
        if out is not None:
            out = self._check_out("reduce_scatter", out, shape, tensor)
        applied = effective_op(op, tensor.dtype)
        if self._may_post(async_op) and data.is_cpu and validation.is_dense(data) and not (
                applied is ReduceOp.AVG and data.dtype in LOW_PRECISION):
            result = out if out is not None else data.new_empty(shape)
            if self._posted("reduce_scatter", data.nbytes, (tensor.shape, tensor.dtype, (("op", op.name),)),
                            self._post_reduce_scatter, data, result,
                            ReduceOp.SUM if applied is ReduceOp.AVG else applied):
                return result.div_(self._world_size) if applied is ReduceOp.AVG else result
        sig = lambda: Signature("reduce_scatter", tuple(tensor.shape), tensor.dtype, (("op", op.name),))

        def run(call: Call) -> torch.Tensor:
            work = work_tensor(data, applied, self._world_size, self._keeps_half_dtype)
            result = self._reduce_scatter(work, ReduceOp.SUM if applied is ReduceOp.AVG else applied,
                                          call, out if work.dtype == data.dtype else None)
            if applied is ReduceOp.AVG:
                average_(result, self._world_size, self._keeps_half_dtype)
            return _into(out, result.to(data.dtype))
        return self._run("reduce_scatter", sig, tensor.nbytes, run, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> torch.Tensor | Work:
        """Copies rank ``src``'s ``tensor`` into ``tensor`` on every rank; returns it."""
        self._check_tensor("broadcast", tensor, written=True)
        src = self._check_peer("broadcast", "src", src)
        sig = lambda: Signature("broadcast", tuple(tensor.shape), tensor.dtype, (("src", src),))
        return self._run("broadcast", sig, tensor.nbytes, lambda call: self._in_place(
            tensor, lambda work: self._broadcast(work, src, call)), async_op)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp | str = ReduceOp.SUM, *,
               async_op: bool = False) -> torch.Tensor | Work:
        """Reduces into ``tensor`` on rank ``dst`` (other ranks' tensors are left unchanged)."""
        op = op if op.__class__ is ReduceOp else ReduceOp.parse(op)
        self._check_tensor("reduce", tensor, written=True)
        dst = self._check_peer("reduce", "dst", dst)
        applied = effective_op(op, tensor.dtype)
        sig = lambda: Signature("reduce", tuple(tensor.shape), tensor.dtype, (("dst", dst), ("op", op.name)))

        def run(call: Call) -> torch.Tensor:
            def apply(work: torch.Tensor) -> None:
                self._reduce(work, dst, ReduceOp.SUM if applied is ReduceOp.AVG else applied, call)
                if applied is ReduceOp.AVG and self._rank == dst:
                    average_(work, self._world_size, self._keeps_half_dtype)
            return self._in_place(tensor, apply, applied, write_back=self._rank == dst)
        return self._run("reduce", sig, tensor.nbytes, run, async_op)

    def gather(self, tensor: torch.Tensor, dst: int, *, async_op: bool = False
               ) -> list[torch.Tensor] | None | Work:
        """Rank ``dst`` gets the list of every rank's ``tensor`` (rank order); others get None."""
        data = self._check_tensor("gather", tensor)
        dst = self._check_peer("gather", "dst", dst)
        sig = lambda: Signature("gather", tuple(tensor.shape), tensor.dtype, (("dst", dst),))
        return self._run("gather", sig, tensor.nbytes,
                         lambda call: self._gather(validation.dense(data), dst, call), async_op)

    def scatter(self, chunks: Sequence[torch.Tensor] | None, src: int, *,
                async_op: bool = False) -> torch.Tensor | Work:
        """Rank ``src`` passes ``world_size`` tensors of one shape and dtype; every rank returns the
        one at its own index, on the CPU if ``src``'s chunks are CPU tensors and on a GPU if they
        are GPU tensors. Other ranks' ``chunks`` are ignored (pass None)."""
        src = self._check_peer("scatter", "src", src)
        nbytes = 0
        if self._rank == src:
            chunks = self._check_chunks("scatter", chunks, same_shape=True)
            nbytes = sum(c.nbytes for c in chunks)
        sig = lambda: Signature("scatter", None, None, (("src", src),))
        own = list(chunks) if self._rank == src else None
        return self._run("scatter", sig, nbytes, lambda call: self._scatter(own, src, call), async_op)

    def all_to_all(self, chunks: Sequence[torch.Tensor], *, async_op: bool = False
                   ) -> list[torch.Tensor] | Work:
        """Rank r sends ``chunks[j]`` to rank j and returns the list whose entry j came from rank j.
        Chunks share a dtype and trailing dims everywhere; dim 0 may differ."""
        chunks = self._check_chunks("all_to_all", chunks, same_shape=False)
        sig = lambda: Signature("all_to_all", (len(chunks), *chunks[0].shape[1:]), chunks[0].dtype)
        return self._run("all_to_all", sig, sum(c.nbytes for c in chunks),
                         lambda call: self._all_to_all(chunks, call), async_op)

    def barrier(self, *, async_op: bool = False) -> None | Work:
        """Returns once every rank of the group has called it."""
        return self._run("barrier", lambda: Signature("barrier"), 0, lambda call: self._barrier(call), async_op)

    def new_group(self, ranks: Sequence[int]):
        """Called by every rank of this group: members get a backend over ``ranks`` (renumbered
        0..k-1 in the order given), the others get None."""
        ranks = self._check_group_ranks(ranks)
        sig = lambda: Signature("new_group", (len(ranks),), None, (("ranks", ranks),))
        group = self._run("new_group", sig, 0, lambda call: self._new_group(ranks, call), async_op=False)
        if group is not None:
            self._groups_made.add(group)  # it ends with this one (shutdown)
        return group

    # ---- point to point --------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Sends ``tensor`` to rank ``dst``; matched by a ``recv`` with the same tag."""
        self._p2p("send", "send", tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Fills ``tensor`` with what rank ``src`` sent with ``tag``; its shape and dtype must match."""
        return self._p2p("recv", "recv", tensor, src, tag).wait()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        return self._p2p("isend", "send", tensor, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        return self._p2p("irecv", "recv", tensor, src, tag)

    def _p2p(self, op: str, direction: str, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        # ``op``: the method the user called, which its errors name.
        data, peer, tag = self._check_p2p(op, tensor, peer, tag)
        self.stats.record(direction, tensor.nbytes)
        if direction == "send":
            return self._isend(validation.dense(data), peer, tag)
        return self._irecv(data, peer, tag)

    def _next_p2p_seq(self, direction: str, peer: int, tag: int) -> int:
        """Number of this message on its (direction, peer, tag) channel, for error messages."""
        key = (direction, peer, tag)
        self._p2p_seq[key] = self._p2p_seq.get(key, 0) + 1
        return self._p2p_seq[key]

    # ---- engine interface ------------------------------------------------------------------------
    @abc.abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, call: Call) -> None:
        """In place; ``op`` is SUM, PRODUCT, MIN or MAX."""

    @abc.abstractmethod
    def _all_gather(self, tensor: torch.Tensor, call: Call, out: torch.Tensor | None = None) -> torch.Tensor:
        """Returns the gathered tensor; engines write into ``out`` when given and convenient
        (the base copies into ``out`` otherwise)."""

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int, call: Call) -> None: ...

    @abc.abstractmethod
    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work: ...

    @abc.abstractmethod
    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work: ...

    @abc.abstractmethod
    def _new_group(self, ranks: list[int], call: Call): ...

    def _shutdown(self) -> None:
        """Engine resources; called once."""

    # ---- shared machinery ------------------------------------------------------------------------
    def _run(self, op: str, make_signature: Callable[[], Signature], nbytes: int,
             fn: Callable[[Call], Any], async_op: bool) -> Any:
        # [Note: hot path] A synchronous call costs a few microseconds of Python here and in the
        # engine (BENCHMARKS.md, MPI at 1 MB): no closure on the synchronous path. Gloo and MPI
        # take a shorter one where they can (distframe.backends.posted).
        call = Call(op, self._count(op, nbytes), make_signature, self.timeout)
        if async_op:
            return self._submit(call, fn)
        if self._pending or self._async_failure is not None:
            self._drain()
        self._check_call(call)
        return fn(call)

    def _stall_check(self, call: Call) -> Callable[[], BaseException | None] | None:
        """For engines that can tell when a pending call can never complete (see FutureWork)."""
        return None

    def _in_place(self, tensor: torch.Tensor, apply: Callable[[torch.Tensor], None],
                  op: ReduceOp | None = None, *, write_back: bool = True) -> torch.Tensor:
        """Runs ``apply`` on ``tensor``'s data, or on the copy ``work_tensor`` makes for ``op``,
        copied back when ``write_back`` (not on a rank that only sends: it may be pre-divided)."""
        data = validation.plain(tensor)
        work = work_tensor(data, op, self._world_size, self._keeps_half_dtype)
        apply(work)
        if work is not data and write_back:
            copy_result(data, work)
        return tensor

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise ValueError(f"{op} called on {self!r} after shutdown(); create a new backend "
                             "(or call it inside spawn) instead of reusing a closed one")

    def _check_tensor(self, op: str, tensor: object, *, written: bool = False) -> torch.Tensor:
        return validation.check_tensor(op, tensor, written=written)

    def _check_peer(self, op: str, name: str, peer: object) -> int:
        return validation.check_peer(op, name, peer, self._world_size)

    def _check_p2p(self, op: str, tensor: object, peer: int, tag: int) -> tuple[torch.Tensor, int, int]:
        self._check_open(op)
        return validation.check_p2p(op, tensor, peer, tag, self._rank, self._world_size, RESERVED_TAG)

    def _check_out(self, op: str, out: object, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return validation.check_out(op, out, shape, like)

    def _check_chunks(self, op: str, chunks: object, *, same_shape: bool) -> list[torch.Tensor]:
        return validation.check_chunks(op, chunks, self._world_size, same_shape=same_shape)

    def _check_group_ranks(self, ranks: object) -> list[int]:
        return validation.check_group_ranks(ranks, self._world_size)


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """``result``, copied into ``out`` if the caller gave one and the engine did not use it."""
    if out is None or result is out:
        return result
    out.copy_(result)
    return out


