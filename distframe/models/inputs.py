"""How a batch's inputs reach a model (``train_step``'s ``batch = (inputs, targets)``), the same
for every strategy."""
from __future__ import annotations

from typing import Any

from torch import nn


def call_with(module: nn.Module, inputs: Any) -> Any:
    """``module`` called on a batch's inputs: a dict as keywords, a tuple or list as arguments."""
    if isinstance(inputs, dict):
        return module(**inputs)
    if isinstance(inputs, (tuple, list)):
        return module(*inputs)
    return module(inputs)
