"""Gradient clipping by the global norm of a sharded model's gradients.

``torch.nn.utils.clip_grad_norm_`` over a rank's own ``parameters()`` sees a shard (ZeRO, FSDP,
tensor and pipeline parallelism) or a replica, not the model: its norm is wrong and ranks clip
by different factors. Here each rank adds up ``|g|^p`` over the gradient ranges it alone counts
(the same one-writer-per-range rule checkpoints use, so replicas and tied copies count once),
one all_reduce (SUM, or MAX for the infinity norm) makes the global norm, and every rank scales
the gradients its optimizer reads by ``min(1, max_norm / (norm + 1e-6))``, as torch does.
"""
from __future__ import annotations

import math

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import ReduceOp
from distframe.errors import ConfigError
from distframe.models.flat import Segment


def clip_sharded_grad_norm(shards: list[torch.Tensor], counted: list[list[Segment]],
                           backend: ICommunicationBackend, max_norm: float,
                           norm_type: float = 2.0) -> torch.Tensor:
    """Clips the ``.grad`` of ``shards`` in place; returns the global norm (float64, the same on
    every rank). ``counted[i]``: the ranges of ``shards[i]`` this rank adds to the norm."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
        raise ConfigError(f"max_norm={max_norm!r}: use a number >= 0")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ConfigError(f"norm_type={norm_type!r}: use a number > 0 or math.inf")
    infinite = math.isinf(norm_type)
    device = shards[0].device if shards else torch.device("cpu")
    parts = [torch.zeros((), dtype=torch.float64, device=device)]
    for shard, segments in zip(shards, counted):
        if shard.grad is None:
            continue
        flat = shard.grad.detach().reshape(-1)
        for s in segments:
            norm = torch.linalg.vector_norm(flat[s.shard_offset:s.shard_offset + s.length], norm_type,
                                            dtype=torch.float64)
            parts.append(norm if infinite else norm.pow(norm_type))
    local = torch.stack(parts).max() if infinite else torch.stack(parts).sum()
    total = local.reshape(1).clone()
    if backend.world_size > 1:
        backend.all_reduce(total, ReduceOp.MAX if infinite else ReduceOp.SUM)
    norm = total[0] if infinite else total[0].pow(1.0 / norm_type)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for shard in shards:
        if shard.grad is not None:
            shard.grad.mul_(scale.to(shard.grad.dtype))
    return norm
