"""ZeRO-1/2 over the data-parallel group of a model-parallel rank.

The rank's trainable local parameters (its stage's, its tensor shard) are laid end to end in one flat space
padded to a multiple of ``dp``; data-parallel rank d owns chunk d and keeps a master copy of it,
which is what the optimizer (ZeRO1Optimizer / ZeRO2Optimizer) updates, so optimizer state is
``1/dp`` of the rank's parameters.

Collectives (data-parallel group): ``reduce_gradients`` runs one reduce_scatter(SUM) of the flat
gradients divided by ``dp``, so each rank averages only the chunk it updates, and
``gather_parameters`` one all_gather of the updated chunks into the parameters: 2(dp-1)/dp of the
parameters on the wire per step, as ``ZeRO1Model``/``ZeRO2Model`` (an all_reduce of the gradients
would make it 3(dp-1)/dp). ZeRO-1 keeps the full gradients, as ``ZeRO1Model`` does: each
parameter's ``.grad`` holds this rank's own gradient, with the chunk it owns replaced by the
average. ZeRO-2 keeps only the chunk's averaged gradient. A further backward before the step (no
zero_grad) adds to the averages, as with torch DDP: ``restart_accumulation`` sets the average
aside before it, and the next reduction adds the new average to it.

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

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import ReduceOp
from distframe.errors import ConfigError
from distframe.models.flat import Segment
from distframe.models.replaced_data import check_not_tied, check_replacement
from distframe.models.sharded_state import ShardLayout


class ZeroShards:
    """This rank's master chunk of the flat local-parameter space (see the module docstring)."""

    def __init__(self, params: list[torch.Tensor], backend: ICommunicationBackend, *, stage: int,
                 device: torch.device | None = None) -> None:
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
        self._reduced = False  # the parameters' .grad holds gradients already reduced
        self._versions: list[int] = []
        self._data = [p.data for p in params]  # their own storage: a replaced .data is copied back
        self._pointers = [t.data_ptr() for t in self._data]
        self.refresh_master()

    def _flat(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        flat = torch.zeros(self.padded, dtype=self.master.dtype, device=self.master.device)
        for p, t, offset in zip(self.params, tensors, self.offsets):
            if t is not None:
                flat[offset:offset + p.numel()] = t.reshape(-1)
        return flat

    def refresh_master(self) -> None:
        """Copies the parameters' values into the master chunk (after construction or a load)."""
        with torch.no_grad():
            self.master.copy_(self._flat([p.detach() for p in self.params])[self.lo:self.lo + self.chunk])
        self._record_versions()

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
        hi = self.lo + self.chunk
        held: set[int] | None = None  # the parameters' own storages, where one was replaced
        with torch.no_grad():
            for i in edited:
                p, offset = self.params[i], self.offsets[i]
                if p.data_ptr() != self._pointers[i]:  # a replaced .data
                    held = held or {t.untyped_storage().data_ptr() for t in self._data}
                    check_not_tied("HybridShardedModel", "a trainable parameter", p.data, held)
                    check_replacement("HybridShardedModel", "a trainable parameter", p.data, self._data[i])
                    self._data[i].copy_(p.data)
                    p.data = self._data[i]
                start, end = max(offset, self.lo), min(offset + p.numel(), hi)
                if start < end:
                    values = p.detach().reshape(-1)[start - offset:end - offset]
                    self.master[start - self.lo:end - self.lo] = values
        self._record_versions()

    def reduce_gradients(self) -> None:
        flat = self._flat([p.grad for p in self.params])
        shard = self.backend.reduce_scatter(flat, ReduceOp.SUM).div_(self.backend.world_size)
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
            self.master.grad = shard
            for p in self.params:
                p.grad = None

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
        flat = self.backend.all_gather(self.master.detach().contiguous())
        with torch.no_grad():
            for p, offset in zip(self.params, self.offsets):
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
        self._record_versions()  # these writes are the masters', not edits

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
