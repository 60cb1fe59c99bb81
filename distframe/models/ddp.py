"""DDPModel: replicated parameters, gradients averaged in buckets overlapped with backward."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import ReduceOp, Work
from distframe.errors import ConfigError
from distframe.models.base import ShardedModelBase
from distframe.models.config import ShardingConfig
from distframe.models.direct_calls import DirectCalls
from distframe.models.dp_modules import prepare_replicated_modules
from distframe.models.flat import FlatSpace, Segment, partition_into_buckets
from distframe.models.gradient_buckets import GradBucket, GradientBuckets
from distframe.models.replicas import mark_wrapped
from distframe.models.sharded_state import ShardLayout
from distframe.precision import refuse_policy

CommHook = Callable[[ICommunicationBackend, GradBucket], Work]


def allreduce_hook(backend: ICommunicationBackend, bucket: GradBucket) -> Work:
    """The default communication hook: average the bucket's flat gradient across ranks, in place."""
    return backend.all_reduce(bucket.buffer, ReduceOp.AVG, async_op=True)


class DDPModel(ShardedModelBase):
    """Distributed data parallel.

    Every rank holds the full parameters, full gradients (``.grad`` of each parameter is a view
    into its bucket's flat buffer) and, with DDPOptimizer or a plain torch.optim optimizer, the
    full optimizer state. Collectives: per bucket (reverse registration order, ``bucket_cap_mb``,
    the first ``first_bucket_cap_mb``), one ``all_reduce(AVG)`` started asynchronously from the
    gradient hooks as soon as the bucket's gradients are accumulated during backward, waited for when
    backward finishes (so a plain optimizer, or clipping, sees averaged gradients), or at the latest
    in ``synchronize_gradients()`` (called by ``train_step``, ``DDPOptimizer.step`` and before a
    plain optimizer's step). A call of the wrapped module itself (``model.module(x)``, ``net(x)``)
    arms the same reduction as the wrapper's call ([Note: the wrapped module called directly]).
    Inside ``no_sync()`` nothing is communicated, an optimizer step included; a step after it
    (outside) averages what backward passes left local when no synchronising backward followed
    ([Note: gradients left local at the step] in gradient_buckets.py). With
    ``find_unused_parameters=True`` a parameter that no rank gave a gradient keeps ``.grad = None``,
    as in torch DDP (see ParameterUsage). Each
    nn.SyncBatchNorm adds one all_gather per training forward and one reduce_scatter in backward
    (sync_batchnorm.py).

    ``register_comm_hook(hook)`` replaces the per-bucket all_reduce: ``hook(backend, bucket)``
    returns a Work whose ``wait()`` gives the averaged flat gradient (or None when the hook wrote
    ``bucket.buffer`` in place). Gradient compression plugs in here. A hook that an optimizer
    registered (``owner``) lasts while that optimizer is the model's: building another optimizer
    for the model restores the all_reduce, so a DDPOptimizer that follows a
    GradientCompressionOptimizer trains as plain DDP. A hook registered by the user stays, and a
    plain torch.optim optimizer, which is not built for the model, changes no hook.
    """

    accepts_plain_optimizer = True
    optimizer_name = "DDPOptimizer"
    skips_unused_parameters = True

    def __init__(self, module: torch.nn.Module, backend: ICommunicationBackend, *,
                 config: ShardingConfig | None = None, **settings: Any) -> None:
        super().__init__(module, backend, config=config, **settings)
        module = self.wrapped_model  # the module itself where a torch.compile'd one was given
        prepare_replicated_modules(self, module, backend)  # SyncBatchNorm, max_norm: dp_modules.py
        mark_wrapped(module, type(self).__name__)  # checks done: the module changes from here
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        spaces = []
        for dtype in sorted({p.dtype for _, p in self._named}, key=str):
            group = [(n, p) for n, p in self._named if p.dtype == dtype]
            spaces += [FlatSpace(b, 1) for b in partition_into_buckets(
                group, first_cap_bytes=self.config.first_bucket_cap_bytes,
                cap_bytes=self.config.bucket_cap_bytes)]
        self._comm_hook: CommHook = allreduce_hook
        self._hook_owner: Any = None  # the optimizer that registered the hook, if one did
        self.gradient_buckets = GradientBuckets(
            spaces, grad_dtype=None, launch=self._launch, complete=self._complete, keep_buffers=True,
            usage=self._parameter_usage,
            peers_on_thread=getattr(backend, "peers_sharing_autograd_thread", None))
        self._direct_calls = DirectCalls(self, arms=True)  # [Note: the wrapped module called directly]

    @property
    def replicates_gradients(self) -> bool:  # type: ignore[override]
        """Every rank holds the same averaged gradients, except while backward passes under no_sync
        left each rank its own until the step averages them: a plain GradScaler's inf check of those
        would not agree (its step then raises ConfigError naming ShardedGradScaler, which agrees)."""
        return not self.gradient_buckets.holds_left_local()

    def _check_config(self, config: ShardingConfig) -> None:
        refuse_policy(config.mixed_precision, type(self).__name__,
                      "for DDP compute in lower precision under torch.autocast (or cast the model "
                      "yourself), or use ZeRO1Model for a MixedPrecisionPolicy")

    def register_comm_hook(self, hook: CommHook, *, owner: Any = None) -> None:
        """Replaces the per-bucket gradient all_reduce (see the class docstring). ``owner``: the
        optimizer registering it, whose hook ends when another optimizer is built for the model."""
        if not callable(hook):
            raise ConfigError("register_comm_hook needs a callable hook(backend, bucket) -> Work")
        self._comm_hook, self._hook_owner = hook, owner

    def attach_optimizer(self, optimizer: Any) -> None:
        """The optimizer built for this model takes it over: an earlier optimizer's hook ends."""
        super().attach_optimizer(optimizer)
        if self._hook_owner is not None and self._hook_owner is not optimizer:
            self._comm_hook, self._hook_owner = allreduce_hook, None

    def _launch(self, bucket: GradBucket) -> Work:
        return self._comm_hook(self.backend, bucket)

    def _complete(self, bucket: GradBucket, result: torch.Tensor | None) -> None:
        if result is not None and result.data_ptr() != bucket.buffer.data_ptr():
            bucket.buffer.copy_(result.reshape(-1))

    # ---- ShardedModelBase ----------------------------------------------------------------------
    def _pre_forward(self) -> None:
        if torch.is_grad_enabled():
            self.gradient_buckets.prepare_for_backward(self._synchronize)

    def _post_forward(self, output: Any) -> Any:
        self.gradient_buckets.watch(output)  # outputs made without grad have nothing to hook
        return output

    def synchronize_gradients(self) -> None:
        self.gradient_buckets.finish(left_local=self._synchronize)

    def before_plain_step(self) -> None:
        # A plain optimizer after backward passes all under no_sync: see synchronize_gradients.
        self.synchronize_gradients()

    def local_parameter_shard(self) -> list[torch.Tensor]:
        return [p for _, p in self._named]

    def shard_layout(self) -> ShardLayout:
        return ShardLayout([p for _, p in self._named],
                           [[Segment(0, n, 0, p.numel())] for n, p in self._named], replicated=True)

    def _gather_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.wrapped_model.named_parameters()}

    def _strategy_buffers(self) -> list[torch.Tensor]:
        return [b.buffer for b in self.gradient_buckets.buckets if b.buffer is not None]
