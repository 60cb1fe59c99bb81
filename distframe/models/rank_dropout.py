"""Dropout of a rank's own generators where no tensor group brings them (tp 1).

[Note: dropout_seed without tensor parallelism]
Under tensor parallelism every dropout already draws from the tensor group's generators
(``tensor_parallel_rng``). Without it, dropout draws from torch's global generator, as under torch
DDP: process ranks seeded by the user repeat their masks, but in-memory ranks are threads sharing
that one generator, whose draws interleave in whatever order the threads run, so two runs with one
seed differ. A model-parallel model given ``dropout_seed`` at tp 1 therefore points each active
dropout of this rank's layers (an ``nn.Dropout`` with ``p > 0``, a ``DilatedAttention`` with
``attention_dropout > 0``) at a TensorParallelRNG of its own, seeded from the seed, its pipeline
stage and its replica: the run repeats, and another seed draws other masks. ``dropout_seed=None``
leaves them on torch's generator. A module of another type (``nn.Dropout2d``, a subclass with its
own forward) still draws from torch's generator. Masks cannot equal one process's, which draws one
mask for the whole batch from one stream.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from attention.dilated import DilatedAttention
from distframe.backends.protocol import ICommunicationBackend
from distframe.mesh import ParallelDims, ParallelGroups
from distframe.models.replaced_modules import refuse_hooked
from distframe.models.tensor_parallel_rng import ReplicatedDropout, TensorParallelRNG, agree_on_seed


class RankDilatedAttention(DilatedAttention):
    """``DilatedAttention`` whose attention-dropout decisions come from ``rng.split_generator``
    (this rank's own) instead of torch's global generator."""

    def __init__(self, dense: DilatedAttention, rng: TensorParallelRNG) -> None:
        super().__init__(dense.segment_lengths, dense.dilation_rates,
                         softmax_scale=dense.softmax_scale, attention_dropout=dense.attention_dropout)
        self.rng = rng
        self.train(dense.training)

    def dropout_generator(self, device: torch.device) -> torch.Generator | None:
        return self.rng.split_generator(device)


def draw_from(model: nn.Module, rng: TensorParallelRNG, include: Callable[[nn.Module], bool],
              *, inactive: bool = False) -> int:
    """Replaces, in place, each ``nn.Dropout`` and ``DilatedAttention`` of ``model`` that
    ``include`` accepts (and that drops something, unless ``inactive``) by one drawing from
    ``rng``; returns how many of those replaced drop something."""
    active = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not (include(child) and (_drops(child) or inactive and _drawn_from_torch(child))):
                continue
            full_name = f"{parent_name}.{name}" if parent_name else name
            refuse_hooked(child, full_name, "dropout_seed")  # [Note: hooks on replaced modules]
            if type(child) is nn.Dropout:
                setattr(parent, name, ReplicatedDropout.from_dense(child, rng, full_name))
            else:
                setattr(parent, name, RankDilatedAttention(child, rng))
            active += _drops(child)
    return active


def _drawn_from_torch(module: nn.Module) -> bool:
    """Whether ``module`` is one ``draw_from`` replaces: its draws come from torch's generator."""
    return type(module) in (nn.Dropout, DilatedAttention)


def _drops(module: nn.Module) -> bool:
    """Whether ``module`` is one ``draw_from`` replaces and it drops something."""
    if type(module) is nn.Dropout:
        return module.p > 0
    return type(module) is DilatedAttention and module.attention_dropout > 0


def stage_dropout_rng(model: nn.Module, mine: Sequence[nn.Module], dropout_seed: int | None,
                      dims: ParallelDims, backend: ICommunicationBackend, groups: ParallelGroups,
                      device: torch.device) -> TensorParallelRNG | None:
    """This rank's dropout generators (collective on ``backend`` when there are any): with tp > 1
    the tensor group's (seed ``dropout_seed``, else rank 0's ``torch.initial_seed()``), which
    tensor parallelism then hands the stage's dropouts; with tp 1 and a ``dropout_seed``, its own,
    already pointed at by the active dropouts of ``mine`` (this rank's layers of ``model``), or None
    where those are none (see the note)."""
    # The same on every rank (one model): no collective where nothing would draw from the generators.
    if not dims.tp_enabled and (dropout_seed is None or not any(map(_drops, model.modules()))):
        return None
    rng = TensorParallelRNG.for_groups(agree_on_seed(dropout_seed, backend, device), groups)
    if dims.tp_enabled:
        return rng
    owned = {id(m) for layer in mine for m in layer.modules()}
    return rng if draw_from(model, rng, lambda m: id(m) in owned) else None
