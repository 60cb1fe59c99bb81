"""ZeRO1Model and ZeRO2Model: replicated parameters, optimizer state (and for ZeRO-2 gradients)
sharded over flat bucket spaces."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import ReduceOp, Work
from distframe.errors import ConfigError
from distframe.models.config import ShardingConfig
from distframe.models.direct_calls import DirectCalls
from distframe.models.flat import FlatSpace, partition_into_buckets
from distframe.models.full_parameters import Summonable
from distframe.models.gradient_buckets import GradBucket, GradientBuckets
from distframe.models.master_weights import MasterChunk, MasterWeightsModelBase
from distframe.models.replaced_data import AttachedData
from distframe.models.replicas import mark_wrapped
from distframe.models.sharded_state import ShardLayout
from distframe.precision import MixedPrecisionPolicy


def single_dtype(named: list[tuple[str, nn.Parameter]], strategy: str) -> torch.dtype:
    """The one dtype of ``named``; ConfigError naming the first parameter that differs."""
    if not named:
        raise ConfigError(f"{strategy} needs a model with at least one trainable parameter")
    first_name, first = named[0]
    for name, p in named:
        if p.dtype != first.dtype:
            raise ConfigError(f"{strategy} flattens parameters into one space: {name!r} is {p.dtype} "
                              f"but {first_name!r} is {first.dtype}; convert the model to one dtype "
                              "(mixed_precision=MixedPrecisionPolicy(...) handles lower precision)")
    return first.dtype


def cast_frozen(module: nn.Module, param_dtype: torch.dtype | None) -> None:
    """Every frozen floating-point parameter takes ``param_dtype`` (a MixedPrecisionPolicy's; None:
    nothing changes), whatever its own dtype, as FSDP2 computes with every parameter of a group in
    param_dtype and DeepSpeed's bf16 mode casts the whole model: a frozen base left in float32 (or
    float16) beside bfloat16 trainable ones failed in its first layer, since no input dtype suited
    both. They keep no copy in their own dtype (they are not trained, and it would cost twice
    their bytes); a checkpoint holds them in ``param_dtype`` and loads into any dtype."""
    if param_dtype is None:
        return
    with torch.no_grad():
        for param in module.parameters():
            if not param.requires_grad and param.is_floating_point() and param.dtype != param_dtype:
                param.data = param.data.to(param_dtype)


class _ReplicatedParametersShardedState(MasterWeightsModelBase):
    """ZeRO-1/2 machinery. Parameters (compute dtype) are views into one flat buffer per
    gradient bucket; rank r's master shard of a bucket is chunk r of that space (a view of the
    flat buffer itself when no mixed precision is set, else a float32 copy). Floating forward inputs
    are cast to ``param_dtype``; parameters edited in place, or given other ``.data``, reach the
    masters (master_weights.py, replaced_data.py).

    Collectives per step: one ``reduce_scatter(AVG)`` per bucket started from the gradient hooks
    during backward (each rank receives its chunk's averaged gradient), then after the optimizer
    step one ``all_gather`` per bucket of the updated chunks: 2(N-1)/N x parameters on the wire.
    """

    free_gradients = False

    def __init__(self, module: nn.Module, backend: ICommunicationBackend, *,
                 config: ShardingConfig | None = None, **settings: Any) -> None:
        super().__init__(module, backend, config=config, **settings)
        module = self.wrapped_model  # the module itself where a torch.compile'd one was given
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        dtype = single_dtype(named, type(self).__name__)
        mark_wrapped(module, type(self).__name__)  # checks done: the module changes from here
        policy = self.config.mixed_precision or MixedPrecisionPolicy()
        self.compute_dtype = policy.compute_dtype(dtype)
        self._input_dtype = policy.input_dtype
        cast_frozen(module, policy.param_dtype)
        self.reduce_dtype = policy.communication_dtype(dtype)
        master_dtype = policy.master(dtype)
        self._masters_apart = master_dtype != self.compute_dtype  # else a view of the flat buffer
        element = torch.empty(0, dtype=self.compute_dtype).element_size()
        groups = partition_into_buckets(named, first_cap_bytes=self.config.first_bucket_cap_bytes,
                                        cap_bytes=self.config.bucket_cap_bytes, element_size=element)
        self.spaces = [FlatSpace(g, backend.world_size) for g in groups]
        self.flat_parameters: list[torch.Tensor] = []
        self.masters: list[nn.Parameter] = []
        self._attached: list[AttachedData] = []  # the parameters' views of the flat buffers
        for space in self.spaces:
            originals = [p.data for p in space.params]
            flat = space.flatten(originals, self.compute_dtype)
            # Under mixed precision the master comes from the model's own values: taken from
            # ``flat`` it would hold them rounded to the compute dtype.
            master = (space.shard_of(flat, backend.rank) if master_dtype == self.compute_dtype
                      else space.chunk(originals, backend.rank, master_dtype))
            self.flat_parameters.append(flat)
            self.masters.append(nn.Parameter(master))
            self._attached.append(AttachedData(space, self.masters[-1]))
            self._attached[-1].attach(space.views(flat), holds_values=True)
        self.gradient_buckets = GradientBuckets(
            self.spaces, grad_dtype=self.compute_dtype, launch=self._launch,
            complete=self._complete, keep_buffers=not self.free_gradients, usage=self._parameter_usage,
            peers_on_thread=getattr(backend, "peers_sharing_autograd_thread", None),
            accumulate_dtype=self.reduce_dtype)
        self._reduced_buckets: set[int] = set()  # kept buffers already reduced (ZeRO-1)
        # Last: a construction refused by a check leaves no hook on the module.
        self._direct_calls = DirectCalls(self)  # [Note: the wrapped module called directly]

    def _launch(self, bucket: GradBucket) -> Work:
        grad = bucket.buffer if bucket.buffer.dtype == self.reduce_dtype else bucket.buffer.to(self.reduce_dtype)
        accumulated = self.gradient_buckets.take_accumulated(bucket)  # no_sync's, in reduce_dtype
        if accumulated is not None:
            grad = grad.add_(accumulated)
        # The output is allocated here, on the thread that runs backward, as FSDP's units do,
        # rather than by the engine on its communication thread, whose malloc arena would keep
        # the blocks freed later on this thread.
        out = grad.new_empty(bucket.space.shard_numel)
        return self.backend.reduce_scatter(grad, ReduceOp.AVG, out=out, async_op=True)

    def _complete(self, bucket: GradBucket, shard_grad: torch.Tensor) -> None:
        master = self.masters[bucket.index]
        if not self.free_gradients and shard_grad.dtype == master.dtype == bucket.buffer.dtype:
            # ZeRO-1 keeps full gradients anyway: reuse its chunk rather than hold a second copy.
            chunk = bucket.space.shard_of(bucket.buffer, self.backend.rank)
            chunk.copy_(shard_grad)
            shard_grad = chunk
        if not self.free_gradients:
            self._reduced_buckets.add(bucket.index)
        shard_grad = shard_grad.to(master.dtype)
        if master.grad is None:
            master.grad = shard_grad
        else:
            master.grad.add_(shard_grad)

    # ---- ShardedModelBase ----------------------------------------------------------------------
    def _pre_forward(self) -> None:
        if torch.is_grad_enabled():
            self._take_in_place_edits()
            self.gradient_buckets.prepare_for_backward(self._synchronize)
            self._restart_kept_buffers()

    def _post_forward(self, output: Any) -> Any:
        self.gradient_buckets.watch(output)  # outputs made without grad have nothing to hook
        return output

    def _restart_kept_buffers(self) -> None:
        """A backward after a synchronisation, with no zero_grad in between, adds to the averaged
        gradients (as with torch DDP). ZeRO-1's kept buffers then still hold the local gradients
        that were already reduced, with this rank's chunk overwritten by the average (which is
        also its master's ``.grad``): reduced again they would count twice. So the average moves
        to a ``.grad`` of its own and the buffers restart from zero."""
        for index in sorted(self._reduced_buckets):
            bucket, master = self.gradient_buckets.buckets[index], self.masters[index]
            if _in_kept_buffer(master.grad, bucket):
                master.grad = master.grad.clone()
            bucket.buffer.zero_()
        self._reduced_buckets.clear()

    def synchronize_gradients(self) -> None:
        self._take_in_place_edits()  # before the optimizer steps the masters
        # Gradients left by backward passes all under no_sync reach the masters only reduced, so
        # they are reduced now, inside no_sync too (a step there has no local gradients to take):
        # see [Note: gradients left local at the step] in gradient_buckets.py.
        self.gradient_buckets.finish(left_local=True)

    def _attached_data(self) -> list[AttachedData]:
        return self._attached

    def _master_chunks(self) -> list[MasterChunk]:
        if not self._masters_apart:  # the masters are views of the parameters' flat buffers
            return []
        return [(space, master, True) for space, master in zip(self.spaces, self.masters)]

    def synchronize_parameters(self) -> None:
        """All-gathers every bucket's updated chunk straight into the full flat parameters. The
        input is a chunk-sized copy of the master (``out`` must not overlap it, and the master is
        a view of ``flat`` when it needs no cast): no full-size buffer and no full-size copy."""
        works = []
        for flat, master in zip(self.flat_parameters, self.masters):
            chunk = master.detach().to(self.compute_dtype, copy=True)
            works.append(self.backend.all_gather(chunk, out=flat, async_op=True))
        for work in works:
            work.wait()
        # The parameters are ``.data`` views of ``flat``, whose writes leave their version counters
        # alone: a backward over a forward from before this step (or a load) then computed with
        # the new weights, silently, where torch says they were modified in place.
        torch.autograd.graph.increment_version([p for space in self.spaces for p in space.params])

    def _after_load(self) -> None:
        self.synchronize_parameters()

    def _summonable(self) -> list[Summonable]:
        return [Summonable(space, master, flat)
                for space, master, flat in zip(self.spaces, self.masters, self.flat_parameters)]

    def _zero_grad(self) -> None:
        """A zero master ``.grad`` kept by ``zero_grad(set_to_none=False)`` that is ZeRO-1's chunk
        of a kept bucket gets storage of its own: the next reduction writes the average into that
        chunk, then adds it to the master's ``.grad``, which would count it twice."""
        for master, bucket in zip(self.masters, self.gradient_buckets.buckets):
            if _in_kept_buffer(master.grad, bucket):
                master.grad = torch.zeros_like(master.grad)
        self.gradient_buckets.zero_grad()
        self._reduced_buckets.clear()

    def local_parameter_shard(self) -> list[torch.Tensor]:
        return list(self.masters)

    def shard_layout(self) -> ShardLayout:
        return ShardLayout(list(self.masters), [s.segments(self.backend.rank) for s in self.spaces])

    def _gather_parameters(self) -> dict[str, torch.Tensor]:
        out = {}
        for space, master in zip(self.spaces, self.masters):
            full = self.backend.all_gather(master.detach())
            for entry, view in zip(space.entries, space.views(full)):
                out[entry.name] = view.clone()
        return out

    def _strategy_buffers(self) -> list[torch.Tensor]:
        return [t for b in self.gradient_buckets.buckets for t in (b.buffer, b.accumulated) if t is not None]


class ZeRO1Model(_ReplicatedParametersShardedState):
    """ZeRO stage 1: parameters and a full gradient buffer replicated, optimizer state for 1/N
    of the flat parameter space per rank (use ZeRO1Optimizer). Gradients are reduce-scattered per
    bucket during backward: the averaged chunk lands in this rank's slice of the kept buffer, the
    rest keeps this rank's own gradients, so ``.grad`` is no average (clip with
    ``model.clip_grad_norm_``, not torch's function over ``parameters()``); after the local update
    the parameters are all-gathered. Holds 8 + 8/N bytes per parameter for float32 Adam."""

    optimizer_name = "ZeRO1Optimizer"


class ZeRO2Model(_ReplicatedParametersShardedState):
    """ZeRO stage 2: as ZeRO-1, but each bucket's full gradient buffer is freed once its
    reduce-scatter completes, so a rank keeps only its gradient shard (use ZeRO2Optimizer).
    Holds 4 + 12/N bytes per parameter for float32 Adam."""

    optimizer_name = "ZeRO2Optimizer"
    free_gradients = True


def _in_kept_buffer(grad: torch.Tensor | None, bucket: Any) -> bool:
    """Whether ``grad`` (a master's) is a chunk of ``bucket``'s kept buffer (ZeRO-1), which the
    next reduction writes: such a gradient needs storage of its own to be kept."""
    return grad is not None and bucket.buffer is not None and (
        grad.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr())
