"""TensorParallelModel: Megatron column/row/vocab splits applied to a model from outside.

Every rank of the backend holds ``1/tp`` of each planned layer (``tensor_parallel_plan``) and a
replica of the rest; all ranks take the same batch. Forward and backward run the conjugate
``f``/``g`` all-reduces inside the layers (for the LM: one all-reduce of ``(B, T, E)`` per
attention and per MLP each way, one for the embedding forward, an all-gather of the logits);
gradients need no further synchronisation, and a plain torch.optim optimizer over
``model.parameters()`` updates this rank's shards. ``train_step`` adds one all_reduce of the loss.
Dropout masks of replicated activations are the same on every rank (``dropout_seed``, see
``tensor_parallel_rng``); the attention-probability dropout draws per rank, for its own heads.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.mesh import ParallelDims
from distframe.models.hybrid import HybridShardedModel


class TensorParallelModel(HybridShardedModel):
    """``TensorParallelModel(model, backend, *, plan=None, dropout_seed=None)``; ``plan`` maps
    submodule names to ``"column"``, ``"row"`` or ``"vocab"`` (None: ``default_tp_plan``, the LM's);
    ``dropout_seed`` (None: rank 0's ``torch.initial_seed()``) fixes the dropout masks."""

    def __init__(self, model: nn.Module, backend: ICommunicationBackend, *,
                 plan: Mapping[str, str] | None = None, **settings: Any) -> None:
        super().__init__(model, backend, dims=ParallelDims(tp=backend.world_size), tp_plan=plan, **settings)
