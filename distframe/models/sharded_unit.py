"""ShardedUnit: a group of parameters kept as 1/N of one flat space per rank, gathered on demand.

While gathered, the unit's parameters are views into ``full`` (the padded flat space in the
compute dtype). Resharding frees ``full``'s storage (``untyped_storage().resize_(0)``) without
touching the views' metadata, so the views autograd saved during forward become valid again as
soon as ``unshard`` refills the storage before backward. Rank r keeps chunk r as a master
Parameter (float32 under mixed precision) that its optimizer updates.

[Note: parameters between uses] A view of freed storage keeps its shape, and torch reads it as
memory it no longer owns: ``p.sum()``, ``print(p)`` or an EMA of the weights outside forward
crashed the process. So while resharded each parameter holds a stand-in (``p.data``, which
leaves the Parameter, its ``.grad`` and its hooks as they are; a leaf autograd saved is read
through the Parameter, which holds its view again by the time backward needs it): a NaN of its
own (one element of the unit's ``nans``) expanded to the parameter's shape. Shape, dtype and
device stay what user code reads them for (counting parameters, choosing optimizer groups by
``p.dim()``); a read gives NaN, never freed memory or a plausible number, and an in-place write
raises (every element is one memory location; a one-element parameter, which torch lets one
write, writes only its own NaN, and the write is lost at its next gather). Each stand-in has a
data pointer of its own, so another parameter's assigned to its ``.data`` is seen ([Note: a tie
made after wrapping] in replaced_data.py). ``gather_full_parameters()`` gives the values. A
``.data`` the user assigned stays until the model takes it ([Note: a replaced .data] there).
A read inside the model's forward or train_step's loss function is refused, naming the parameter,
in the first such call of each kind ([Note: reads of a resharded parameter] in stand_in_reads.py).
(FSDP1 empties them instead, shape ``(0,)``, which breaks that user code.)

Collectives: ``unshard`` is one all_gather of the chunk (optionally asynchronous, for prefetch);
``reduce_gradients`` is one asynchronous reduce_scatter(AVG) of the flattened gradients.

[Note: gathering in place] ``unshard`` refills ``full``'s storage and all-gathers the master
chunks straight into it (``out=``), so no second full-size tensor exists at any point: the
engines write into the caller's buffer (the MPI engine hands MPI its address, pinning nothing,
so ``reshard`` can empty the storage again). An earlier version gathered into a fresh tensor and
copied it into ``full``; that copy, allocated on the backend's communication thread for every
prefetch, is what kept FSDPModel's peak RSS above FSDP2's (BENCHMARKS.md, issue 4).
"""
from __future__ import annotations

import torch
from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import ReduceOp, Work
from distframe.models.config import TrainingState
from distframe.models.flat import FlatSpace
from distframe.models.replaced_data import AttachedData
from distframe.precision import MixedPrecisionPolicy, finer


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
        # no_sync's gradients add up in reduce_dtype when it is finer than the compute dtype
        # (``keep_accumulated``), as GradientBuckets' ``accumulate_dtype``.
        self.accumulates = finer(self.reduce_dtype, self.compute_dtype)
        self.accumulated: torch.Tensor | None = None
        self._position = {id(p): k for k, p in enumerate(self.space.params)}
        originals = [p.data for _, p in named_params]
        self.full = self.space.flatten(originals, self.compute_dtype)
        # From the model's own values: ``full`` holds them rounded to the compute dtype.
        self.master = nn.Parameter(self.space.chunk(originals, backend.rank, policy.master(dtype)))
        self._views = list(self.space.views(self.full))
        # Held while resharded, one NaN per parameter: an in-place edit between steps (fill_ on a
        # one-element parameter, zero_ on a bias: torch sees no overlap in writing one value)
        # reaches no other parameter, and one parameter given another's stand-in moves its pointer.
        nans = torch.full((len(self.space.entries),), float("nan"), dtype=self.full.dtype,
                          device=self.full.device)
        self._stand_ins = [nans[k].expand(e.shape) for k, e in enumerate(self.space.entries)]
        # How a read of a parameter holding its stand-in is told apart (stand_in_reads.py).
        self.stand_in_pointers = frozenset(t.data_ptr() for t in self._stand_ins)
        # See [Note: a replaced .data] in replaced_data.py; ``full`` and ``nans``: what it holds.
        self.attached = AttachedData(self.space, self.master, also_held=(self.full, nans))
        self.attached.attach(self._views, holds_values=True)
        self.state = TrainingState.IDLE
        self.is_unsharded = True
        self.stale = False
        # Whether the module's forward ran (gathering the current masters) since they last changed:
        # see [Note: a unit whose forward does not run] in unit_lifecycle.py.
        self.forward_ran = False
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

    @property
    def prefetch_in_flight(self) -> bool:
        """Whether an asynchronous gather was started and nothing has waited for it yet."""
        return self._gather is not None

    def unshard(self, *, async_op: bool = False) -> None:
        """Gathers the full parameters (already there: nothing); ``async_op`` only starts it.
        See [Note: gathering in place]."""
        if self.is_unsharded and not self.stale:
            return
        if self._gather is None:
            storage = self.full.untyped_storage()
            if storage.nbytes() < self._full_bytes:
                kept = self.attached.replaced()  # until taken: see [Note: a replaced .data]
                storage.resize_(self._full_bytes)
                self.attached.attach(self._views, holds_values=True, keep=kept)
            shard = self.master.detach().to(self.compute_dtype)
            self._gather = self.backend.all_gather(shard, out=self.full, async_op=True)
        if not async_op:
            self._wait_for_gather()

    def _wait_for_gather(self) -> None:
        self._gather.wait()
        self._gather = None
        self.is_unsharded, self.stale = True, False

    def reshard(self) -> None:
        """Frees the gathered parameters (persistent units keep them) and finishes a prefetch that
        was not used, so no gather is still writing into ``full`` when its storage goes."""
        self.drop_prefetch()
        if self.persistent or not self.is_unsharded:
            return
        kept = self.attached.replaced()  # before the views' storage goes (their pointer with it)
        self.full.untyped_storage().resize_(0)
        # See [Note: parameters between uses]; a replaced .data stays until taken.
        self.attached.attach(self._stand_ins, holds_values=False, keep=kept)
        self.is_unsharded = False

    def drop_prefetch(self) -> None:
        """Waits for a gather in flight; ``full`` then holds the masters' values as of its start
        (``mark_stale`` marks them old when the masters changed since)."""
        if self._gather is not None:
            self._wait_for_gather()

    def keep_accumulated(self, param: nn.Parameter) -> None:
        """Under no_sync, with ``accumulates``: moves ``param``'s gradient into the
        ``accumulated`` sum, in reduce_dtype, and frees it."""
        if self.accumulated is None:
            self.accumulated = torch.zeros(self.space.padded_numel, dtype=self.reduce_dtype,
                                           device=self.full.device)
        self.space.view(self.accumulated, self._position[id(param)]).add_(param.grad)
        param.grad = None

    def reduce_gradients(self) -> Work:
        """Flattens the parameters' gradients (None reads as zeros) with what no_sync
        accumulated, frees them and starts the reduce_scatter that leaves this rank's averaged
        chunk; ``accumulate`` takes its result."""
        flat = self.space.flatten([p.grad for p in self.params], self.reduce_dtype)
        if self.accumulated is not None:
            flat.add_(self.accumulated)
            self.accumulated = None
        for param in self.params:
            param.grad = None
        self.reduce_launched = True
        # The output is allocated here, on the calling thread, not by the engine on its
        # communication thread: memory freed into that thread's malloc arena stays there.
        out = flat.new_empty(flat.shape[0] // self.backend.world_size)
        return self.backend.reduce_scatter(flat, ReduceOp.AVG, out=out, async_op=True)

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
