"""The global mean loss a hybrid or tensor-parallel ``train_step`` returns, with the check that every
rank of a tensor-parallel group was given the same batch.

[Note: one batch per tensor group] The ranks of a tensor-parallel group each hold a part of every
split layer and compute one forward together, so ``train_step``'s batch is the same on all of them:
their data-parallel slice. The DDP habit (each rank slicing the global batch by its own rank) gave
them different slices; the step trained a model of neither slice, silently, and train_step
returned a different "global" loss on each rank (1.2168 and 1.1829). The ranks of a group compute
their loss bitwise alike from one batch (replicated computation on all-reduced activations, and
every engine's all_reduce leaves the same bits on every rank: checked on the in-memory, Gloo and
MPI engines), so their losses must be equal exactly (NaN on every rank of a group is no mismatch).
With ``tp > 1`` the loss is all-gathered over the tensor group (``tp`` float64s), and whether the
group agreed rides along with the loss in the all_reduce(AVG) over the replica group that the mean
needs anyway: a rank then knows whether any tensor group of its pipeline stage disagreed, and every
stage sees the same (the loss is broadcast over each pipeline first), so every rank raises (a rank
whose own group agreed would otherwise wait for the others in its next collective). Without tensor
parallelism nothing changes. Cost: one all_gather of 8 bytes per rank over the tensor group per
step. The loss exists only after the optimizer stepped, so the refused step has moved the weights.
"""
from __future__ import annotations

import math

import torch

from distframe.backends.types import ReduceOp
from distframe.errors import ConfigError
from distframe.mesh import ParallelGroups

_FIX = ("Every rank of a tensor-parallel group passes the same batch: its data-parallel slice (the whole "
        "batch without data parallelism), not a slice of its own per rank as under DDP; slice the global "
        "batch by model.data_parallel_coordinates() (dp, dp_index), not by rank")


def global_mean_loss(loss: torch.Tensor, groups: ParallelGroups) -> float:
    """The mean loss over the global batch, the same float on every rank. Collective: over the
    tensor group (with tp > 1: ConfigError on every rank unless each tensor group's losses agree),
    then over the replica group (none when it has one rank)."""
    total = loss.detach().to(torch.float64).reshape(1).clone()
    disagreement = None
    if groups.tp.world_size > 1:
        losses = groups.tp.all_gather(total).tolist()
        odd = next((k for k, value in enumerate(losses) if not _same(value, losses[0])), None)
        if odd is not None:
            disagreement = (f"tensor-parallel ranks 0 and {odd} of this rank's group computed the losses "
                            f"{losses[0]!r} and {losses[odd]!r}")
        total = torch.cat([total, total.new_tensor([float(odd is not None)])])
    # Every rank of a replica holds its replica's loss (broadcast over the pipeline group, the same
    # across the tensor group), so the mean over the replica group (dp x cp: equal slices) is the
    # global mean.
    if groups.replicas.world_size > 1:
        groups.replicas.all_reduce(total, ReduceOp.AVG)
    if total.numel() > 1 and float(total[1]) > 0:
        raise ConfigError(
            f"the ranks of a tensor-parallel group computed different losses from the batches they were "
            f"given ({disagreement or 'on another group of this pipeline stage'}), so they were given "
            f"different batches and this step trained on none of them. {_FIX}")
    return float(total[0])


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))
