"""ShardedUnit: a group of parameters kept as 1/N of one flat space per rank, gathered on demand.

The unit's parameters are views into ``full`` (the padded flat space in the compute dtype).
Resharding frees ``full``'s storage (``untyped_storage().resize_(0)``) without touching any
tensor's metadata, so the views autograd saved during forward become valid again as soon as
``unshard`` refills the storage before backward. Rank r keeps chunk r as a master Parameter
(float32 under mixed precision) that its optimizer updates.

Collectives: ``unshard`` is one all_gather of the chunk (optionally asynchronous, for prefetch);
``reduce_gradients`` is one asynchronous reduce_scatter(AVG) of the flattened gradients.

[Note: freeing the gathered copy] The all_gather returns a new full-size tensor that ``unshard``
copies into ``full``; its storage is then emptied at once (``_release``) instead of being left to
garbage collection. The backend keeps the result of every asynchronous call until its next
synchronous collective (the loss all_reduce, after backward), so without this each unit's
gathered copy, from forward and again from backward, stayed allocated to the end of the step: up
to twice the model above the shards, ~27 MiB more than FSDP2 at the peak of a 5.3M-parameter LM.
(Gathering straight into ``full`` with ``out=`` would save the copy, but ``out=`` is not part of
ICommunicationBackend and the MPI engine pins the memory it is given, so ``full`` could no longer
be freed.) A copy whose memory an engine pinned stays until the backend lets go of it.
"""
from __future__ import annotations

import torch
from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import ReduceOp, Work
from distframe.models.config import TrainingState
from distframe.models.flat import FlatSpace
from distframe.precision import MixedPrecisionPolicy


class ShardedUnit:
    """``named_params`` (one dtype) owned by ``module``'s hooks; ``persistent`` units stay
    gathered between steps (only their master, gradient and optimizer state are sharded)."""

    def __init__(self, index: int, module: nn.Module, named_params: list[tuple[str, nn.Parameter]],
                 backend: ICommunicationBackend, policy: MixedPrecisionPolicy, *, persistent: bool) -> None:
        self.index = index
        self.module = module
        self.backend = backend
        self.persistent = persistent
        self.space = FlatSpace(named_params, backend.world_size)
        dtype = named_params[0][1].dtype
        self.compute_dtype = policy.compute_dtype(dtype)
        self.reduce_dtype = policy.communication_dtype(dtype)
        self.full = self.space.flatten([p.data for _, p in named_params], self.compute_dtype)
        chunk = self.space.shard_of(self.full, backend.rank)
        self.master = nn.Parameter(chunk.to(policy.master(dtype), copy=True))
        with torch.no_grad():
            for param, view in zip(self.space.params, self.space.views(self.full)):
                param.data = view
        self.state = TrainingState.IDLE
        self.is_unsharded = True
        self.stale = False
        self.ready: set[int] = set()
        self.reduce_launched = False
        self._gather: Work | None = None
        self._full_bytes = self.full.numel() * self.full.element_size()
        self.reshard()

    @property
    def params(self) -> list[nn.Parameter]:
        return self.space.params

    @property
    def full_bytes(self) -> int:
        return self._full_bytes

    def unshard(self, *, async_op: bool = False) -> None:
        """Gathers the full parameters (already there: nothing); ``async_op`` only starts it."""
        if self.is_unsharded and not self.stale:
            return
        if self._gather is None:
            shard = self.master.detach().to(self.compute_dtype)
            self._gather = self.backend.all_gather(shard, async_op=True)
        if not async_op:
            self._wait_for_gather()

    def _wait_for_gather(self) -> None:
        gathered = self._gather.wait()
        self._gather = None
        storage = self.full.untyped_storage()
        if storage.nbytes() < self._full_bytes:
            storage.resize_(self._full_bytes)
        with torch.no_grad():
            self.full.copy_(gathered)
        self._release(gathered)
        self.is_unsharded, self.stale = True, False

    def reshard(self) -> None:
        """Frees the gathered parameters (persistent units keep them) and drops a prefetch that
        was not used, so no gather of old values outlives the step."""
        self.drop_prefetch()
        if self.persistent or not self.is_unsharded:
            return
        self.full.untyped_storage().resize_(0)
        self.is_unsharded = False

    def drop_prefetch(self) -> None:
        if self._gather is not None:
            self._release(self._gather.wait())
            self._gather = None

    def _release(self, gathered: torch.Tensor) -> None:
        """Empties a gathered copy's storage once copied out (see [Note: freeing the gathered
        copy]); never the master's (a backend may hand back its input when world_size is 1)."""
        storage = gathered.untyped_storage()
        if storage.resizable() and storage.data_ptr() != self.master.untyped_storage().data_ptr():
            storage.resize_(0)

    def reduce_gradients(self) -> Work:
        """Flattens the parameters' gradients (None reads as zeros), frees them and starts the
        reduce_scatter that leaves this rank's averaged chunk; ``accumulate`` takes its result."""
        flat = self.space.flatten([p.grad for p in self.params], self.reduce_dtype)
        for param in self.params:
            param.grad = None
        self.reduce_launched = True
        return self.backend.reduce_scatter(flat, ReduceOp.AVG, async_op=True)

    def accumulate(self, shard_grad: torch.Tensor) -> None:
        shard_grad = shard_grad.to(self.master.dtype)
        if self.master.grad is None:
            self.master.grad = shard_grad
        else:
            self.master.grad.add_(shard_grad)

    def gather_full(self) -> dict[str, torch.Tensor]:
        """Every parameter at master precision (one all_gather of the master chunk)."""
        full = self.backend.all_gather(self.master.detach())
        return {e.name: v.clone() for e, v in zip(self.space.entries, self.space.views(full))}
