"""nn.SyncBatchNorm synchronised over a data-parallel wrapper's group rather than torch.distributed's.

[Note: SyncBatchNorm under distframe]
torch's nn.SyncBatchNorm synchronises through torch.distributed's default group (or the
``process_group`` it was built with), which distframe's backends never initialise: under every
data-parallel strategy it silently normalised each rank's slice by the slice's own statistics, as
plain BatchNorm does (1.25 off the global batch's in a small model). So a data-parallel wrapper
over more than one rank points the ``forward`` of each nn.SyncBatchNorm of the model at a
``SynchronisedBatchNorm`` over its data-parallel group (the backend; a hybrid model's dp x cp
replicas): one instance attribute, as zero_grad_route.py sets ``zero_grad``. Not hooks: a forward
hook cannot stop torch's forward, which normalises by the slice and writes the running statistics
from it. Not a module put in its place: the user's references to the module, its hooks and the
ZeRO-3/FSDP units built on it would all have to follow.

In training mode each rank computes, per channel, its slice's count, mean and sum of squared
deviations (M2); one differentiable all_gather of them (backward: reduce_scatter, so every rank's
loss reaches every rank's rows through the statistics) and their exact merge (Chan et al.) give the
global batch's mean and biased variance, which normalise the slice. Slices of different sizes (an
empty one too) merge exactly, without the cancellation of a sum of squares. The running
statistics take the global mean and unbiased variance (global count - 1) with BatchNorm's momentum
(or its cumulative average), identical on every rank. In eval mode torch's own forward runs, which
communicates nothing. The wrapper is held weakly: once it is gone, and in a deep or pickled copy of
the module, torch's SyncBatchNorm runs (outside a process group: each slice on its own).
Refused (ConfigError): a ``process_group`` (a torch.distributed group, over which distframe cannot
communicate), and a subclass with a ``forward`` of its own, which this one would skip.
"""
from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from torch import nn

from distframe.backends import functional
from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError


def check_sync_batch_norms(module: nn.Module, strategy: str) -> None:
    """ConfigError for an nn.SyncBatchNorm of ``module`` that cannot synchronise over the wrapper's
    group (see the note); no communication, nothing changed."""
    for name, sub in module.named_modules():
        if not isinstance(sub, nn.SyncBatchNorm):
            continue
        shown = f"'{name}' ({type(sub).__name__})" if name else f"the model ({type(sub).__name__})"
        if sub.process_group is not None:
            raise ConfigError(
                f"{strategy}: nn.SyncBatchNorm {shown} was built with process_group={sub.process_group!r}, "
                "a torch.distributed group, over which distframe's backends do not communicate; build "
                "it with process_group=None (convert_sync_batchnorm(model) without a group) and it "
                f"synchronises over {strategy}'s data-parallel group")
        own = sub.__dict__.get("forward")
        if type(sub).forward is not nn.SyncBatchNorm.forward or (
                own is not None and not isinstance(own, SynchronisedBatchNorm)):
            raise ConfigError(
                f"{strategy}: {shown} is an nn.SyncBatchNorm with a forward of its own, which {strategy} "
                "cannot synchronise over its data-parallel group (it would run nn.SyncBatchNorm's "
                "forward in its place); use nn.SyncBatchNorm itself, and put what the subclass adds "
                "in a module around it")


def synchronise_batch_norms(module: nn.Module, owner: Any, group: ICommunicationBackend) -> None:
    """Points every nn.SyncBatchNorm of ``module`` at ``group`` while ``owner`` (the wrapper, held
    weakly) lives; nothing where the group has one rank. Checked by ``check_sync_batch_norms``."""
    if group.world_size == 1:
        return
    for sub in module.modules():
        if isinstance(sub, nn.SyncBatchNorm):
            sub.__dict__["forward"] = SynchronisedBatchNorm(sub, owner, group)


class SynchronisedBatchNorm:
    """Stands in for ``module.forward`` of an nn.SyncBatchNorm (see the note)."""

    def __init__(self, module: nn.SyncBatchNorm, owner: Any | None,
                 group: ICommunicationBackend | None) -> None:
        self._module = module
        self._owner = None if owner is None else weakref.ref(owner)
        self._group = group

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        bn = self._module
        if self._owner is None or self._owner() is None or not bn.training:
            return type(bn).forward(bn, input)  # eval mode: the running statistics, no communication
        bn._check_input_dim(input)
        bn._check_non_zero_input_channels(input)
        momentum = 0.0 if bn.momentum is None else bn.momentum
        if bn.track_running_stats:  # as _BatchNorm.forward
            bn.num_batches_tracked.add_(1)
            if bn.momentum is None:  # a cumulative average
                momentum = 1.0 / float(bn.num_batches_tracked)
        tracked = bn.track_running_stats and bn.running_mean is not None
        return batch_norm_over_group(input, bn.weight, bn.bias, bn.running_mean if tracked else None,
                                     bn.running_var if tracked else None, momentum, bn.eps, self._group)

    def __deepcopy__(self, memo: dict[int, Any]) -> SynchronisedBatchNorm:
        return SynchronisedBatchNorm(copy.deepcopy(self._module, memo), None, None)

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _unbound, (self._module,)


def _unbound(module: nn.SyncBatchNorm) -> SynchronisedBatchNorm:
    return SynchronisedBatchNorm(module, None, None)


def batch_norm_over_group(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                          running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                          momentum: float, eps: float, group: ICommunicationBackend) -> torch.Tensor:
    """Training-mode batch norm of this rank's ``input`` (N, C, *) by the statistics of every rank's
    input together; updates the running statistics in place. One all_gather of (1 + 2C) values
    forward, one reduce_scatter of them backward."""
    channels = input.shape[1]
    reduced = [0, *range(2, input.dim())]
    shape = [1, channels] + [1] * (input.dim() - 2)
    x = input.to(torch.promote_types(input.dtype, torch.float32))  # half inputs: statistics in float32
    count = input.numel() // channels
    mean = x.sum(reduced) / max(count, 1)  # an empty slice: zeros, which its count of 0 weighs out
    m2 = (x - mean.view(shape)).square().sum(reduced)
    mine = torch.cat([mean.new_full((1,), float(count)), mean, m2]).unsqueeze(0)
    table = functional.all_gather(mine, group)  # (world, 1 + 2C): each rank's count, mean, M2
    counts, means, m2s = table[:, :1], table[:, 1:1 + channels], table[:, 1 + channels:]
    total = float(counts.detach().sum())
    if total <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got {total:g} over the "
                         f"{group.world_size} data-parallel ranks (input {tuple(input.shape)} here)")
    global_mean = (counts * means).sum(0) / total
    global_m2 = m2s.sum(0) + (counts * (means - global_mean).square()).sum(0)
    out = (x - global_mean.view(shape)) * torch.rsqrt(global_m2 / total + eps).view(shape)
    if weight is not None:
        out = out * weight.view(shape) + bias.view(shape)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            unbiased = global_m2 / (total - 1)
            running_mean.copy_(momentum * global_mean + (1 - momentum) * running_mean)
            running_var.copy_(momentum * unbiased + (1 - momentum) * running_var)
    return out.to(input.dtype)
