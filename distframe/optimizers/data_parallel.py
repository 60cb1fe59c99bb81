"""The optimizers of the data-parallel family, one per model strategy.

Each is a ShardedOptimizerBase whose wrapped torch.optim optimizer sees only this rank's shards:
the full parameters for DDP, the master chunks of the flat spaces for ZeRO and FSDP.
"""
from __future__ import annotations

import torch

from distframe.models.ddp import DDPModel
from distframe.models.fsdp import FSDPModel
from distframe.models.zero import ZeRO1Model, ZeRO2Model
from distframe.models.zero3 import ZeRO3Model
from distframe.optimizers.base import ShardedOptimizerBase


class DDPOptimizer(ShardedOptimizerBase):
    """Optimizer for DDPModel: full, replicated optimizer state. ``step()`` waits for the
    gradient all_reduces, then updates locally; no parameter communication. An optimizer
    instance keeps its param groups, each with its own settings (its shards are the parameters)."""

    model_class = DDPModel

    def _needs_sharded_scaler_because(self) -> str:
        # Refused only while backward passes under no_sync left each rank its own gradients.
        return ("holds this rank's own gradients until this step averages what backward passes "
                "under no_sync left, so a plain torch.amp.GradScaler finds inf/nan on some ranks and "
                "not on others (they would skip different steps and keep different scales); "
                "ShardedGradScaler agrees on it across ranks")

    def synchronize_optimizer_state(self) -> None:
        """Broadcasts rank 0's optimizer state tensors to every rank (one broadcast each)."""
        backend = self.model.backend
        for shard in self.model.local_parameter_shard():
            for value in self.wrapped_optimizer.state.get(shard, {}).values():
                if isinstance(value, torch.Tensor):
                    backend.broadcast(value, 0)


class ZeRO1Optimizer(ShardedOptimizerBase):
    """Optimizer for ZeRO1Model: state for 1/N of each bucket's flat space; ``step()`` waits for
    the gradient reduce-scatters, updates the chunk, all-gathers the parameters. An optimizer
    instance keeps its param groups: each chunk is updated in pieces, one per run of one group's
    parameters (views of the chunk: no other memory or communication; see param_groups.py)."""

    model_class = ZeRO1Model


class ZeRO2Optimizer(ShardedOptimizerBase):
    """Optimizer for ZeRO2Model (as ZeRO1Optimizer, param groups too; the model keeps only
    gradient shards)."""

    model_class = ZeRO2Model


class ZeRO3Optimizer(ShardedOptimizerBase):
    """Optimizer for ZeRO3Model: updates this rank's master chunk of every module; parameters
    are gathered again at the next forward, so ``step()`` itself does not communicate. An
    optimizer instance keeps its param groups, as under ZeRO1Optimizer."""

    model_class = ZeRO3Model


class FSDPOptimizer(ShardedOptimizerBase):
    """Optimizer for FSDPModel: updates this rank's master chunk of every unit; no
    communication in ``step()`` (units are gathered at the next forward). An optimizer instance
    keeps its param groups, as under ZeRO1Optimizer."""

    model_class = FSDPModel
