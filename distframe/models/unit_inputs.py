"""after_inputs_backward: a callback run once the gradients of a module's forward inputs are
computed, which is where a sharded unit's backward ends (see [Note: where a unit's backward ends]
in unit_lifecycle.py).

Gradient hooks on the input tensors, not an identity autograd Function in front of the module
(FSDP2's way): the Function's outputs are views that autograd forbids modifying in place, so a
module whose forward begins with ``nn.ReLU(inplace=True)`` or ``x += ...`` would stop working.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_leaves


class _Countdown:
    """Calls ``callback`` when the last of ``count`` hooked gradients of one backward arrives."""

    def __init__(self, count: int, callback: Callable[[], None]) -> None:
        self.count = count
        self.left = count
        self.callback = callback

    def __call__(self, grad: torch.Tensor) -> None:
        self.left -= 1
        if self.left == 0:
            self.left = self.count  # a second backward over the same graph (retain_graph)
            self.callback()


def after_inputs_backward(args: tuple, kwargs: dict, callback: Callable[[], None]) -> bool:
    """Hooks the tensors among ``args`` and ``kwargs`` that require grad so that ``callback``
    runs once all their gradients are computed; False when none requires grad."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        return False
    countdown = _Countdown(len(tensors), callback)
    for tensor in tensors:
        tensor.register_hook(countdown)
    return True
