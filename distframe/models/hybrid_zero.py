"""ZeRO-1/2 over the data-parallel group of a model-parallel rank.

The rank's trainable local parameters (its stage's, its tensor shard) are laid end to end in one flat space
padded to a multiple of ``dp``; data-parallel rank d owns chunk d and keeps a master copy of it,
which is what the optimizer (ZeRO1Optimizer / ZeRO2Optimizer) updates, so optimizer state is
``1/dp`` of the rank's parameters.

Collectives (data-parallel group): ``reduce_gradients`` reduce-scatters (SUM) the flat
gradients, divided by ``dp``, so each rank averages only the chunk it updates, and
``gather_parameters`` all-gathers the updated chunks into the parameters: 2(dp-1)/dp of the
parameters on the wire per step, as ``ZeRO1Model``/``ZeRO2Model`` (an all_reduce of the gradients
would make it 3(dp-1)/dp), in rounds ([Note: rounds over the chunks]). ZeRO-1 keeps the full
gradients, as ``ZeRO1Model`` does: each parameter's ``.grad`` holds this rank's own gradient, with
the chunk it owns replaced by the average. ZeRO-2 keeps only the chunk's averaged gradient. A
further backward before the step (no zero_grad) adds to the averages, as with torch DDP:
``restart_accumulation`` sets the average aside before it, and the next reduction adds the new
average to it.

In-place edits of the parameters after wrapping (``model.module.load_state_dict(pretrained)``,
``module.apply(init_fn)``, ``p.mul_(0.5)`` under ``torch.no_grad()`` between steps) edit what
forward computes with, not the master chunk the optimizer steps, whose next gather would overwrite
them. So, as ZeRO1Model/ZeRO2Model do ([Note: in-place edits after wrapping] in master_weights.py),
each parameter's ``_version`` is recorded after every write of the masters into the parameters (and
of the parameters into the masters), and ``take_in_place_edits`` (each ``synchronize_gradients``, so
before the optimizer steps) copies this rank's range of a parameter whose version moved into the
master: one attribute read per parameter, no communication (every rank makes the same edit). A
replaced ``.data`` (``p.data = p.data * 0.5``), which moves no version, is found by its data pointer
(one more read), taken the same way, and its values copied into the parameter's own storage, which
it points at again ([Note: a replaced .data] in replaced_data.py; forward computes with it until
then, as one process would); one sharing a parameter's own storage (``b.data = a.data``, a tie
made after wrapping, which the master chunk laid out at wrapping cannot follow) is refused
([Note: a tie made after wrapping] there). A write in place through ``p.data``
(``p.data.mul_(2)``) moves neither and is lost, as under ZeRO-1/2 with a MixedPrecisionPolicy;
write through the parameter under ``torch.no_grad()``.
"""
from __future__ import annotations

import bisect

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import ReduceOp
from distframe.errors import ConfigError
from distframe.models.config import ShardingConfig
from distframe.models.flat import Segment
from distframe.models.replaced_data import check_not_tied, check_replacement
from distframe.models.sharded_state import ShardLayout


class ZeroShards:
    """This rank's master chunk of the flat local-parameter space (see the module docstring).
    ``bucket_cap_bytes``: the most one round hands to a collective (None: ShardingConfig's default);
    there are at least ``MIN_ROUNDS`` where the chunks have as many elements."""

    MIN_ROUNDS = 4

    def __init__(self, params: list[torch.Tensor], backend: ICommunicationBackend, *, stage: int,
                 device: torch.device | None = None, bucket_cap_bytes: int | None = None) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ConfigError(f"data_parallel='zero{stage}' flattens a rank's parameters into one space "
                              f"but they have dtypes {sorted(map(str, dtypes))}; convert the model to one dtype")
        self.params, self.backend, self.stage = params, backend, stage
        self.offsets = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.chunk = -(-total // backend.world_size)
        self.total, self.padded = total, self.chunk * backend.world_size
        self.lo = backend.rank * self.chunk
        # A stage with nothing to train (all frozen) keeps an empty chunk and still takes part.
        dtype = params[0].dtype if params else torch.get_default_dtype()
        self.master = torch.zeros(self.chunk, dtype=dtype, device=params[0].device if params else device)
        cap = bucket_cap_bytes or ShardingConfig().bucket_cap_bytes
        # Elements of every rank's chunk that one round moves ([Note: rounds over the chunks]).
        self.round = max(1, min(-(-self.chunk // self.MIN_ROUNDS),
                                cap // (self.master.element_size() * backend.world_size)))
        self._reduced = False  # the parameters' .grad holds gradients already reduced
        self._versions: list[int] = []
        self._data = [p.data for p in params]  # their own storage: a replaced .data is copied back
        self._pointers = [t.data_ptr() for t in self._data]
        self.refresh_master()

    def refresh_master(self) -> None:
        """Copies the parameters' values into the master chunk (after construction or a load)."""
        with torch.no_grad():
            self.master.zero_()  # the padding past the last parameter
            for i in range(len(self.params)):
                self._copy_into_master(i)
        self._record_versions()

    def _copy_into_master(self, i: int) -> None:
        """This rank's range of parameter ``i``, if any, into the master chunk."""
        p, offset = self.params[i], self.offsets[i]
        start, end = max(offset, self.lo), min(offset + p.numel(), self.lo + self.chunk)
        if start < end:
            self.master[start - self.lo:end - self.lo] = p.detach().reshape(-1)[start - offset:end - offset]

    def _record_versions(self) -> None:
        """The parameters' ``_version`` (count of in-place writes) when they and the master agree."""
        self._versions = [p._version for p in self.params]

    def take_in_place_edits(self) -> None:
        """Copies this rank's range of each parameter written in place since the masters and the
        parameters last agreed into the master chunk (see the module docstring); local."""
        edited = [i for i, (p, v, pointer) in enumerate(zip(self.params, self._versions, self._pointers))
                  if p._version != v or p.data_ptr() != pointer]
        if not edited:
            return
        held: set[int] | None = None  # the parameters' own storages, where one was replaced
        with torch.no_grad():
            for i in edited:
                p = self.params[i]
                if p.data_ptr() != self._pointers[i]:  # a replaced .data
                    held = held or {t.untyped_storage().data_ptr() for t in self._data}
                    check_not_tied("HybridShardedModel", "a trainable parameter", p.data, held)
                    check_replacement("HybridShardedModel", "a trainable parameter", p.data, self._data[i])
                    self._data[i].copy_(p.data)
                    p.data = self._data[i]
                self._copy_into_master(i)
        self._record_versions()

    # [Note: rounds over the chunks]
    # The flat space is one padded run cut into dp chunks (the layout that checkpoints and optimizer
    # state record), so it has no buckets of its own to reduce or gather one at a time. A round takes
    # the same columns [start, stop) of every rank's chunk instead: their reduce_scatter, laid out in
    # rank order, gives each rank its own chunk's columns, and the all_gather of the masters' columns
    # gives every rank's, written straight into the parameters. What the collectives add to the flat
    # gradients (into which each .grad moves) and the gradient shard is then a round's columns, twice
    # on Gloo (which copies a reduce_scatter's input, and gathers into a buffer of its own), where one
    # collective over the whole space added full-size copies. A round is at most a quarter of the
    # space (MIN_ROUNDS) and at most bucket_cap_bytes, so these copies stay under the flat copy of
    # the gradients that data_parallel="ddp" all-reduces: a ZeRO step peaks within DDP's plus the
    # shards (tests/models/test_hybrid_zero_memory.py). The bytes on the wire are the same whatever
    # the number of rounds; each round costs a collective's latency.
    def _rounds(self) -> list[tuple[int, int]]:
        """``(start, stop)`` within every rank's chunk of each round; one (empty) round without
        parameters, so that a stage with nothing to train still takes part."""
        starts = range(0, self.chunk, self.round)
        return [(start, min(start + self.round, self.chunk)) for start in starts] or [(0, 0)]

    def _take_gradients(self) -> torch.Tensor:
        """The gradients laid end to end in the flat space (a missing one as zeros), each ``.grad``
        let go once copied: kept until the reduction ends, they doubled the gradients' memory."""
        flat = torch.zeros(self.padded, dtype=self.master.dtype, device=self.master.device)
        for p, offset in zip(self.params, self.offsets):
            if p.grad is not None:
                flat[offset:offset + p.numel()] = p.grad.reshape(-1)
                p.grad = None
        return flat

    def reduce_gradients(self) -> None:
        flat = self._take_gradients()
        world = self.backend.world_size
        shard = torch.empty_like(self.master)
        columns = flat.view(world, self.chunk)  # row r: rank r's chunk
        for start, stop in self._rounds():
            # Columns [start, stop) of every chunk, in rank order: ``flat`` itself in one round.
            part = columns[:, start:stop].contiguous().view(-1)
            self.backend.reduce_scatter(part, ReduceOp.SUM, out=shard[start:stop])
            del part  # before the next round's copy is made
        shard.div_(world)
        if self.master.grad is not None:  # an earlier backward's average (no zero_grad since)
            shard.add_(self.master.grad)
        self._reduced = True
        if self.stage == 1:
            owned = flat[self.lo:self.lo + self.chunk]
            owned.copy_(shard)
            self.master.grad = owned
            for p, offset in zip(self.params, self.offsets):
                p.grad = flat[offset:offset + p.numel()].view_as(p)
        else:
            self.master.grad = shard  # the parameters' .grad already let go (_take_gradients)

    def restart_accumulation(self) -> None:
        """Before a backward that follows a reduction (no zero_grad in between). ZeRO-1's ``.grad``
        still holds the local gradients already reduced, the owned chunk holding the average that
        is also the master's ``.grad``: reduced again they would count twice. So the average gets
        a ``.grad`` of its own and the parameters' gradients restart from nothing."""
        if not self._reduced:
            return
        if self.stage == 1 and self.master.grad is not None:
            self.master.grad = self.master.grad.clone()
        for p in self.params:
            p.grad = None
        self._reduced = False

    def gather_parameters(self) -> None:
        """All-gathers the updated chunks into the parameters, round by round, so that what it
        allocates is one round's gathered columns, not a second copy of the parameters."""
        world, master = self.backend.world_size, self.master.detach()
        with torch.no_grad():
            for start, stop in self._rounds():
                gathered = self.backend.all_gather(master[start:stop]).view(world, stop - start)
                for rank, values in enumerate(gathered):
                    self._write_parameters(rank * self.chunk + start, values)
        self._record_versions()  # these writes are the masters', not edits

    def _write_parameters(self, first: int, values: torch.Tensor) -> None:
        """Writes ``values`` into the parameters from position ``first`` of the flat space on (the
        padding left out), in place, so that a graph saved before the step sees the write."""
        end = min(first + values.numel(), self.total)
        position, i = first, bisect.bisect_right(self.offsets, first) - 1
        while position < end:
            p, offset = self.params[i], self.offsets[i]
            stop = min(offset + p.numel(), end)
            if position < stop:
                piece, target = values[position - first:stop - first], p.detach()
                if target.is_contiguous():
                    target.view(-1)[position - offset:stop - offset].copy_(piece)
                else:  # put_ indexes a tensor of any layout as if it were flat
                    index = torch.arange(position - offset, stop - offset, device=piece.device)
                    target.put_(index, piece)
                position = stop
            i += 1

    def layout(self, param_segments: list[list[Segment]]) -> ShardLayout:
        """Which dense ranges the master chunk holds, from each local parameter's segments."""
        hi = self.lo + self.chunk
        segments = []
        for offset, segs in zip(self.offsets, param_segments):
            for s in segs:
                start, end = max(offset + s.shard_offset, self.lo), min(offset + s.shard_offset + s.length, hi)
                if start < end:
                    shift = start - (offset + s.shard_offset)
                    segments.append(Segment(start - self.lo, s.name, s.param_offset + shift, end - start))
        return ShardLayout(shards=[self.master], segments=[segments])
