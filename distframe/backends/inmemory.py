"""InMemoryCommunicationBackend: ranks are threads of one process meeting at a shared rendezvous.

Data moves by direct tensor copies between the threads' buffers, so the engine works for any
device torch supports. Reductions are split by rank: rank r reduces element range r of every
input (in rank order, so results are bitwise identical on all ranks and deterministic) and writes
it straight into every rank's output, so the ranks share the memory traffic. A small all_reduce
or reduce_scatter (``WHOLE_REDUCE_BYTES``) is reduced whole by one rank, in the same order (the
same bits), and copied by each: there the split's world_size small ops per rank cost more than
the data.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from distframe.backends.base import DEFAULT_TIMEOUT, Call, CommunicationBackendBase
from distframe.backends.cuda_streams import settle
from distframe.backends.departures import Departure
from distframe.backends.reduction import reduce_into
from distframe.backends.rendezvous import STALL_GRACE, Rendezvous, Slot, World, autograd_device
from distframe.backends.types import CompletedWork, ReduceOp, Work
from distframe.backends.validation import check_wait_timeout
from distframe.errors import CollectiveMismatchError


# An all_reduce or reduce_scatter of at most this many bytes is reduced whole, once, by the first
# rank there to ask: split by rank, it cost every rank world_size small ops (an all_reduce of 1 KB
# took twice as long at world 4: BENCHMARKS.md).
WHOLE_REDUCE_BYTES = 128 * 1024


class InMemoryCommunicationBackend(CommunicationBackendBase):
    """One rank of a group of threads. Build a whole group with :meth:`create_group` (or let
    ``distframe.launch.spawn`` do it); every collective checks that all ranks made the same call
    and raises ``CollectiveMismatchError`` otherwise; a rank that fails inside ``spawn`` makes
    the others raise ``RankFailedError`` at once, and one whose function returns, or that shuts
    its backend down, makes those that wait for it there raise ``CollectiveTimeoutError`` at once
    (``distframe.backends.departures``)."""

    engine = "inmemory"
    _compares_signatures = True  # every rendezvous compares full signatures; debug adds nothing

    def __init__(self, rank: int, world_size: int, rendezvous: Rendezvous | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT, debug: bool = False) -> None:
        super().__init__(rank, world_size, timeout=timeout, debug=debug)
        if rendezvous is None:
            if world_size != 1:
                raise ValueError("a group of more than one in-memory rank shares one rendezvous: "
                                 "use InMemoryCommunicationBackend.create_group(world_size)")
            rendezvous = Rendezvous(World(), [0])
        if rendezvous.size != world_size:
            raise ValueError(f"rendezvous is for {rendezvous.size} ranks, not {world_size}")
        self._rdv = rendezvous
        rendezvous.world.enlist(rendezvous.global_ranks[rank], self)

    @classmethod
    def create_group(cls, world_size: int, *, timeout: float = DEFAULT_TIMEOUT,
                     debug: bool = False) -> list[InMemoryCommunicationBackend]:
        """Every rank's backend of a new group of ``world_size`` threads (rank order)."""
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        rdv = Rendezvous(World(), list(range(world_size)))
        return [cls(r, world_size, rdv, timeout=timeout, debug=debug) for r in range(world_size)]

    @property
    def world(self) -> World:
        return self._rdv.world

    @property
    def global_ranks(self) -> list[int]:
        """The ranks of the top-level group that this group's ranks 0..k-1 are."""
        return list(self._rdv.global_ranks)

    def peers_sharing_autograd_thread(self) -> list[int]:
        device = autograd_device()
        if device is None:
            return []
        me = self._rdv.global_ranks[self._rank]
        shared = set(self._rdv.world.ranks_on_gpu(device, self._rdv.global_ranks)) - {me}
        return [r for r, g in enumerate(self._rdv.global_ranks) if g in shared]

    # ---- the meeting pattern -------------------------------------------------------------------
    def _collective(self, call: Call, payload: Any, body: Callable[[Slot], Any]) -> Any:
        # CUDA: the inputs are written before peers read them, and what this rank wrote before
        # it departs ([Note: the caller's stream] in cuda_streams).
        slot = self._rdv.arrive(self._rank, call.seq, call.signature, settle(payload), call.timeout)
        try:
            return body(slot)
        finally:
            settle(payload)
            self._rdv.depart(self._rank, call.seq, slot, call.op, call.timeout)

    def _stall_check(self, call: Call) -> Callable[[], BaseException | None]:
        """Asked while a thread waits on this call's Work: an error when the ranks it waits for
        can never arrive (``[Note: ranks sharing a GPU, waiting inside backward]``)."""
        def check() -> BaseException | None:
            absent = self._rdv.missing_ranks(call.seq) - {self._rank}
            return self._rdv.stall_error(call.op, call.seq, absent, STALL_GRACE)
        return check

    def _missing_ranks(self, seq: int) -> list[int]:
        return sorted(self._rdv.missing_ranks(seq))

    def _ranks_in_world(self) -> list[int] | None:
        return self._rdv.world_ranks

    def _element_range(self, numel: int) -> slice:
        per_rank = -(-numel // self._world_size)
        start = min(numel, self._rank * per_rank)
        return slice(start, min(numel, start + per_rank))

    # ---- raw collectives -----------------------------------------------------------------------
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, call: Call) -> None:
        def body(slot: Slot) -> None:
            if op in (ReduceOp.SUM, ReduceOp.PRODUCT):
                sharing = self._rdv.compute_once(slot, "sharing", lambda: _sharing_ranks(slot.inputs))
                if sharing:
                    raise ValueError(
                        f"all_reduce: ranks {sharing} passed tensors that share memory; in-memory "
                        f"ranks are threads of one process, so a {op.name} in place into one tensor "
                        "would count it more than once: give each rank a tensor of its own "
                        "(tensor.clone(), or copy.deepcopy(model) per rank)")
            if tensor.nbytes <= WHOLE_REDUCE_BYTES:
                tensor.copy_(self._reduced_whole(slot, tensor, op))
                return
            part = self._element_range(tensor.numel())
            flats = [slot.inputs[r].view(-1)[part] for r in range(self._world_size)]
            # Only this rank touches range `part` of the inputs, so it may reduce into rank 0's
            # copy of it and then copy that to the others; the depart barrier keeps every rank
            # here until all ranges are written. No temporary: two memory passes per input.
            reduced = reduce_into(flats[0], flats, op)
            for flat in flats[1:]:
                flat.copy_(reduced)
        self._collective(call, tensor, body)

    def _all_gather(self, tensor: torch.Tensor, call: Call, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._collective(call, tensor, lambda slot: torch.cat(
            [slot.inputs[r] for r in range(self._world_size)], out=out))

    def _reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp, call: Call,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        def body(slot: Slot) -> torch.Tensor:
            if tensor.nbytes <= WHOLE_REDUCE_BYTES:
                mine = self._reduced_whole(slot, tensor, op).chunk(self._world_size)[self._rank]
                return mine.clone() if out is None else out.copy_(mine)
            chunks = [slot.inputs[r].chunk(self._world_size)[self._rank] for r in range(self._world_size)]
            return reduce_into(torch.empty_like(chunks[0]) if out is None else out, chunks, op)
        return self._collective(call, tensor, body)

    def _reduced_whole(self, slot: Slot, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        """Every rank's input of ``slot`` folded with ``op`` in rank order, computed once by the
        first rank to ask (``WHOLE_REDUCE_BYTES``); the inputs are not read after it."""
        return self._rdv.compute_once(slot, "reduced", lambda: settle(reduce_into(
            torch.empty_like(tensor), [slot.inputs[r] for r in range(self._world_size)], op)))

    def _broadcast(self, tensor: torch.Tensor, src: int, call: Call) -> None:
        def body(slot: Slot) -> None:
            if self._rank != src:
                tensor.copy_(slot.inputs[src])
        self._collective(call, tensor, body)

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, call: Call) -> None:
        def body(slot: Slot) -> None:
            # Only dst reads the inputs, so it may overwrite its own as soon as it has reduced.
            if self._rank == dst:
                inputs = [slot.inputs[r] for r in range(self._world_size)]
                tensor.copy_(reduce_into(torch.empty_like(tensor), inputs, op))
        self._collective(call, tensor, body)

    def _gather(self, tensor: torch.Tensor, dst: int, call: Call) -> list[torch.Tensor] | None:
        return self._collective(call, tensor, lambda slot: [
            slot.inputs[r].clone() for r in range(self._world_size)] if self._rank == dst else None)

    # A chunk passed as a strided view is received contiguous, as from the other engines (a plain
    # clone kept the sender's strides, so .view() on the result failed on this engine only).
    def _scatter(self, chunks: list[torch.Tensor] | None, src: int, call: Call) -> torch.Tensor:
        return self._collective(call, chunks, lambda slot: slot.inputs[src][self._rank].clone(
            memory_format=torch.contiguous_format))

    def _all_to_all(self, chunks: list[torch.Tensor], call: Call) -> list[torch.Tensor]:
        return self._collective(call, chunks, lambda slot: [
            slot.inputs[j][self._rank].clone(memory_format=torch.contiguous_format)
            for j in range(self._world_size)])

    def _barrier(self, call: Call) -> None:
        self._collective(call, None, lambda slot: None)

    def _new_group(self, ranks: list[int], call: Call) -> InMemoryCommunicationBackend | None:
        def body(slot: Slot) -> Rendezvous:
            return self._rdv.compute_once(slot, "group", lambda: Rendezvous(
                self._rdv.world, [self._rdv.global_ranks[r] for r in ranks]))
        child = self._collective(call, None, body)
        if self._rank not in ranks:
            return None
        return type(self)(ranks.index(self._rank), len(ranks), child, timeout=self.timeout,
                          debug=self.debug)

    # ---- point to point ------------------------------------------------------------------------
    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        seq = self._next_p2p_seq("send", dst, tag)
        # Buffered (eager) send: the payload is a copy, so the caller may reuse its tensor at once,
        # and neither this send nor shutdown waits for a receiver (one that left never takes it).
        self._rdv.post(self._rank, dst, tag, seq, settle(tensor.clone()))
        return CompletedWork(None)

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        seq = self._next_p2p_seq("recv", src, tag)
        return _RecvWork(self, tensor, src, tag, seq)

    # ---- life cycle ------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        # This rank makes no further call here (its function under spawn has returned, or raised).
        failed = self._rdv.world.failed_rank == self._rdv.global_ranks[self._rank]
        sent, received = ({(peer, tag): n for (way, peer, tag), n in self._p2p_seq.items()
                           if way == direction} for direction in ("send", "recv"))
        self._rdv.departures.setdefault(self._rank, Departure(self._seq, failed, sent, received))
        # Peers waiting here for a call this rank never issued, or a message it never sent, stop
        # at once (Rendezvous._departed_error) rather than at their next one-second look.
        self._rdv.wake_all()

    def departures(self) -> dict[int, Departure]:
        return {r: d for r, d in list(self._rdv.departures.items()) if r != self._rank}


def _sharing_ranks(inputs: dict[int, torch.Tensor]) -> list[int]:
    """The ranks whose (contiguous) inputs overlap another rank's in memory, sorted; [] if none.
    Threads can hand a collective one tensor, which separate processes never can."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), r)
                   for r, t in inputs.items() if t.numel())
    sharing: set[int] = set()
    reach, owner = -1, -1  # the furthest end seen so far, and whose span it is
    for start, end, rank in spans:
        if start < reach:
            sharing.update((rank, owner))
        if end > reach:
            reach, owner = end, rank
    return sorted(sharing)


class _RecvWork(Work):
    """A receive completes when its message is taken from the mailbox, in ``wait`` or in an
    ``is_completed`` that finds it there."""

    def __init__(self, backend: InMemoryCommunicationBackend, tensor: torch.Tensor, src: int,
                 tag: int, seq: int) -> None:
        self._backend, self._tensor, self._src, self._tag, self._seq = backend, tensor, src, tag, seq
        self._done = False
        # The receive failed after it took its message (one of another shape or dtype, or a copy
        # into the tensor that raised): every later wait raises the same error (waiting for the
        # taken message again ran into the timeout).
        self._error: Exception | None = None

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        timeout = check_wait_timeout(timeout)
        if self._error is not None:
            raise self._error
        if self._done:
            return self._tensor
        b = self._backend
        _, payload = b._rdv.take(self._src, b.rank, self._tag, self._seq,
                                 b.timeout if timeout is None else timeout)
        if payload.shape != self._tensor.shape or payload.dtype != self._tensor.dtype:
            self._error = CollectiveMismatchError(
                "recv", self._seq, f"rank {self._src} sent shape {tuple(payload.shape)} "
                f"{payload.dtype} with tag {self._tag}, rank {b.rank} expects shape "
                f"{tuple(self._tensor.shape)} {self._tensor.dtype}")
            raise self._error
        try:
            self._tensor.copy_(payload)
        except Exception as exc:  # noqa: BLE001 - the message is taken: every wait raises it
            self._error = exc
            raise
        self._done = True
        return self._tensor

    def is_completed(self) -> bool:
        """True once the message is in the tensor (taken now if it has arrived, as MPI and Gloo
        fill the tensor before they say so), or once it failed after taking it (wait raises why)."""
        if self._done or self._error is not None:
            return True
        if not self._backend._rdv.has_message(self._src, self._backend.rank, self._tag, self._seq):
            return False
        try:
            self.wait()
        except Exception:  # a receive that failed after taking its message has completed
            if self._error is None:
                raise
        return True
