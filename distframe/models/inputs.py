"""How a batch's inputs reach a model (``train_step``'s ``batch = (inputs, targets)``), the same
for every strategy."""
from __future__ import annotations

from typing import Any

from torch import nn

from distframe.errors import ConfigError


def call_with(module: nn.Module, inputs: Any) -> Any:
    """``module`` called on a batch's inputs: a dict as keywords, a tuple or list as arguments."""
    if isinstance(inputs, dict):
        return module(**inputs)
    if isinstance(inputs, (tuple, list)):
        return module(*inputs)
    return module(inputs)


def train_batch(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of train_step's ``batch``; a ConfigError for anything else."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ConfigError("train_step expects batch=(inputs, targets) for this rank's slice")
    return batch[0], batch[1]
