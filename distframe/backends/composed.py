"""Collectives composed from the few every engine implements (all_reduce, all_gather,
broadcast, point to point), used where an engine has no native version of its own; and
``scattered_to``, where the engines with a scatter of their own place its result."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator

import torch

from distframe.backends.signature import DTYPES, Signature, describe_mismatch
from distframe.backends.types import ReduceOp
from distframe.errors import CollectiveMismatchError

# Tag reserved for the composed all_to_all; user tags must be below it.
RESERVED_TAG = 2**20


_CALL_TAG: contextvars.ContextVar[tuple[tuple[str, object], ...]] = contextvars.ContextVar(
    "distframe_call_tag", default=())


@contextlib.contextmanager
def tagged_calls(*args: tuple[str, object]) -> Iterator[None]:
    """Adds ``args`` (name, value pairs) to the signature of every call this thread makes inside
    the block, so that a call made under another tag, or none, on some rank is a mismatch where
    signatures are compared (in-memory always, same-node Gloo and MPI ranks, ``debug=True``).
    The differentiable collectives tag their calls with the autograd pass they belong to."""
    token = _CALL_TAG.set(_CALL_TAG.get() + args)
    try:
        yield
    finally:
        _CALL_TAG.reset(token)


def call_tag() -> tuple[tuple[str, object], ...]:
    """The arguments ``tagged_calls`` adds to calls made now on this thread."""
    return _CALL_TAG.get()


class Call:
    """One numbered call on one group, handed to the engine's raw method. The signature is built
    only when asked for (the in-memory engine and ``debug`` mode), keeping the hot path short;
    it takes the ``tagged_calls`` arguments in force where the call was made."""

    __slots__ = ("op", "seq", "timeout", "_make_signature", "_signature", "_tag")

    def __init__(self, op: str, seq: int, make_signature: Callable[[], Signature], timeout: float) -> None:
        self.op, self.seq, self.timeout = op, seq, timeout
        self._make_signature = make_signature
        self._signature: Signature | None = None
        self._tag = _CALL_TAG.get()

    @property
    def signature(self) -> Signature:
        if self._signature is None:
            signature = self._make_signature()
            if self._tag:
                signature = dataclasses.replace(signature, args=signature.args + self._tag)
            self._signature = signature
        return self._signature


class ComposedCollectives:
    """Default raw methods of CommunicationBackendBase, each built from the required ones."""

    _rank: int
    _world_size: int

    def _check_signature(self, call: Call) -> None:
        """``debug=True``: every rank's signature of ``call``, all-gathered, must be the same."""
        mine = call.signature.encode(call.seq)
        # Named as the call it checks: a peer that never arrives times out naming that call.
        check = Call(call.op, call.seq, lambda: Signature("all_gather", tuple(mine.shape), mine.dtype),
                     call.timeout)
        everyone = self._all_gather(mine, check).view(self._world_size, -1)
        if not bool((everyone == mine).all()):
            # Every rank's text decoded alike, this rank's own too, so that equal calls group
            # together; then this rank's call in full, which the encoding abbreviates.
            texts = {r: Signature.decode(everyone[r]) for r in range(self._world_size)}
            raise CollectiveMismatchError(call.op, call.seq, f"{describe_mismatch(texts)}; this rank "
                                          f"(rank {self._rank}) called {call.signature.describe()}")

    def _reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp, call: Call,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        work = tensor.clone()
        self._all_reduce(work, op, call)
        return work.chunk(self._world_size)[self._rank].clone()

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, call: Call) -> None:
        work = tensor.clone()
        self._all_reduce(work, op, call)
        if self._rank == dst:
            tensor.copy_(work)

    def _gather(self, tensor: torch.Tensor, dst: int, call: Call) -> list[torch.Tensor] | None:
        gathered = self._all_gather(tensor.reshape(1, *tensor.shape), call)
        return list(gathered.unbind(0)) if self._rank == dst else None

    def _scatter(self, chunks: list[torch.Tensor] | None, src: int, call: Call) -> torch.Tensor:
        meta = scatter_header(chunks, 8)
        self._broadcast(meta, src, call)
        shape, dtype, on_cpu = read_scatter_header(meta, src)
        full = (torch.stack(chunks) if chunks is not None
                else torch.empty((self._world_size, *shape), dtype=dtype, device="cpu" if on_cpu else "cuda"))
        self._broadcast(full, src, call)
        return scattered_to(full[self._rank].clone(), on_cpu)

    def _all_to_all(self, chunks: list[torch.Tensor], call: Call) -> list[torch.Tensor]:
        sizes = torch.tensor([c.shape[0] for c in chunks], dtype=torch.int64)
        all_sizes = self._all_gather(sizes, call).view(self._world_size, self._world_size)
        sends = [self._isend(c.contiguous(), j, RESERVED_TAG) for j, c in enumerate(chunks) if j != self._rank]
        out: list[torch.Tensor] = []
        recvs = []
        for j in range(self._world_size):
            if j == self._rank:
                out.append(chunks[j].clone())
                continue
            buf = chunks[0].new_empty((int(all_sizes[j, self._rank]), *chunks[0].shape[1:]))
            out.append(buf)
            recvs.append(self._irecv(buf, j, RESERVED_TAG))
        for w in sends + recvs:
            w.wait()
        return out

    def _barrier(self, call: Call) -> None:
        self._all_reduce(torch.zeros(1), ReduceOp.SUM, call)


def scatter_header(chunks: list[torch.Tensor] | None, max_dims: int) -> torch.Tensor:
    """What rank ``src`` of a scatter sends the others before the data, since only it knows:
    the chunks' number of dims, dtype code (``signature.DTYPES``), whether they are CPU tensors,
    then their shape. More than ``max_dims`` dims or a dtype without a code is sent as such, so
    every rank raises alike in ``read_scatter_header`` instead of the others waiting for data
    that never comes. Other ranks pass None (their header is overwritten by src's)."""
    meta = torch.zeros(3 + max_dims, dtype=torch.int64)
    if chunks is not None:
        shape, dtype = chunks[0].shape, chunks[0].dtype
        meta[1] = DTYPES.index(dtype) if dtype in DTYPES else 0
        meta[2] = int(chunks[0].device.type == "cpu")
        if len(shape) > max_dims:
            meta[0] = -1
        else:
            meta[0] = len(shape)
            meta[3:3 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    return meta


def read_scatter_header(meta: torch.Tensor, src: int) -> tuple[tuple[int, ...], torch.dtype, bool]:
    """(shape, dtype, source on the CPU) from a ``scatter_header``, or ValueError on every rank."""
    ndim, code, on_cpu = meta[:3].tolist()
    if ndim < 0:
        raise ValueError(f"scatter: rank {src}'s chunks have more than {meta.numel() - 3} dims; "
                         "reshape them to fewer and back")
    if not 0 < code < len(DTYPES):
        raise ValueError(f"scatter: rank {src}'s chunks have a dtype this engine cannot send "
                         "(quantized or bit-packed); scatter a view of them as an integer dtype")
    return tuple(meta[3:3 + ndim].tolist()), DTYPES[code], bool(on_cpu)


def scattered_to(out: torch.Tensor, source_on_cpu: bool) -> torch.Tensor:
    """A scatter's received chunk where ``scatter`` promises it: on the CPU when the source rank's
    chunks were CPU tensors, else on a GPU (this rank's own, or the current CUDA device of an
    engine that stages GPU tensors through the host). Only ``src`` knows where its chunks live;
    the engines send that along with their shape."""
    if source_on_cpu:
        return out.cpu()
    if out.device.type == "cpu":
        return out.to(torch.device("cuda", torch.cuda.current_device()))
    return out
