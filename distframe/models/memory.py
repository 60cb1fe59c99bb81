"""What ``ShardedModelBase.memory_footprint()`` counts: distinct tensor storage a rank holds."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from distframe.models.plain_optimizer_guard import plain_optimizers


def storage_footprint(model: Any) -> dict[str, int]:
    """Bytes of ``model``'s (a ShardedModelBase) parameters, gradients, optimizer state (its
    ShardedOptimizer's, or that of plain torch.optim ones that stepped it) and strategy buffers,
    each storage counted once, in that order, and their total."""
    seen: set[int] = set()
    params = list(model.wrapped_model.parameters()) + list(model.local_parameter_shard())
    grads = [p.grad for p in params if p.grad is not None]
    optimizers = plain_optimizers(model)
    attached = model._optimizer  # noqa: SLF001 (the model's own record of its ShardedOptimizer)
    if getattr(attached, "wrapped_optimizer", None) is not None:
        optimizers.append(attached.wrapped_optimizer)
    state = [v for opt in optimizers for s in opt.state.values() for v in s.values()]
    state += attached.held_tensors() if hasattr(attached, "held_tensors") else []  # error feedback
    out = {"parameters": _storage_bytes(params, seen), "gradients": _storage_bytes(grads, seen),
           "optimizer_state": _storage_bytes(state, seen),
           "buffers": _storage_bytes(model._strategy_buffers(), seen)}  # noqa: SLF001
    out["total"] = sum(out.values())
    return out


def _storage_bytes(tensors: Iterable[Any], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        key = t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else 0
        if key == 0 or key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total
