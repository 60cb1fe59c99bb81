"""IShardedModel: what a training loop, the checkpoint module and the optimizers need of a model
strategy. ``ShardedModelBase`` implements it; code that accepts any strategy types against this."""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.models.config import ShardingConfig


@runtime_checkable
class IShardedModel(Protocol):
    """A model wrapped by a distributed strategy; this object is one rank's part of it.

    ``gather_full_parameters()`` is identical on every rank; ``state_dict()`` holds this rank's
    shard only (``distframe.checkpoint`` saves and re-shards it); ``memory_footprint()`` counts
    the bytes of real storage this rank holds.
    """

    wrapped_model: nn.Module
    backend: ICommunicationBackend
    config: ShardingConfig

    def forward(self, *args: Any, **kwargs: Any) -> Any: ...

    def local_parameter_shard(self) -> list[torch.Tensor]: ...

    def gather_full_parameters(self) -> dict[str, torch.Tensor]: ...

    def synchronize_gradients(self) -> None: ...

    def no_sync(self) -> AbstractContextManager[None]: ...

    def train_step(self, batch: tuple[Any, Any], loss_fn: Callable[[Any, Any], torch.Tensor],
                   optimizer: Any) -> float: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any: ...

    def memory_footprint(self) -> dict[str, int]: ...
