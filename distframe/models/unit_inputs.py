"""after_inputs_backward: a callback run when the gradients of a module's forward inputs are
computed, which is where a sharded unit's backward ends (see [Note: where a unit's backward ends]
in unit_lifecycle.py)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class _InputsBackward(torch.autograd.Function):
    """Identity on its tensors; its backward calls ``callback`` and passes the gradients on."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


def after_inputs_backward(args: tuple, kwargs: dict,
                          callback: Callable[[], None]) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` with every tensor that requires grad routed through one node whose
    backward calls ``callback``; None (leave the call as it is) when no tensor requires grad."""
    leaves, spec = tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves)
                 if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    if not positions:
        return None
    routed = _InputsBackward.apply(callback, *(leaves[i] for i in positions))
    for i, tensor in zip(positions, routed):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)
