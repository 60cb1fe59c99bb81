"""IShardedOptimizer: what a training loop and the checkpoint module need of an optimizer
strategy. ``ShardedOptimizerBase`` implements it around any ``torch.optim`` optimizer."""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class IShardedOptimizer(Protocol):
    """One rank's part of an optimizer that belongs with a model strategy (``model``).

    ``step()`` synchronizes gradients first and parameters after, as the strategy needs;
    ``state_dict()`` holds this rank's shard of the state; ``should_early_stop(flag)`` is True on
    every rank when any rank passes True.
    """

    wrapped_optimizer: torch.optim.Optimizer

    def step(self, closure: Any = None) -> Any: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def synchronize_optimizer_state(self) -> None: ...

    def synchronize_parameters(self) -> None: ...

    def should_early_stop(self, local_flag: bool) -> bool: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], reader: Any = None) -> None: ...
