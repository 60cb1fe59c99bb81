"""The tensor-parallel dropout generators (``TensorParallelRNG``) in a checkpoint.

Each rank of a model with ``tp > 1`` (or with tp 1 and a ``dropout_seed``, where its stage has an
active dropout: ``models.rank_dropout``) saves its generators' ``state_dict()`` as pieces
``dropout_rng/stage<p>.replica<r>.tp<t>/<entry>@0`` (its pipeline stage, data-parallel x context
replica and tensor rank; ``<entry>`` is ``seeds`` or ``<region>.<device type>``), and the
metadata records the layout, ``{"dp", "tp", "pp", "cp"}``, under ``dropout_rng``: any rank's, as
each puts its ``layout`` into the file table the save gathers (``agreed_layout``), for with tp 1
world rank 0's stage may hold no active dropout, and so no generators, while later stages save
theirs. A load into a model of the same layout gives each rank its own generators back, so the
resumed run draws the uninterrupted run's masks. Other cases:

* a checkpoint without them (saved before distframe kept them, or by a model without tensor
  parallelism): the model keeps its own generators, from its seed;
* a model without tensor parallelism or ``dropout_seed``: nothing to restore (plain
  ``nn.Dropout`` draws from torch's global generator, which no checkpoint holds); with tp 1, a
  stage whose saved model had no active dropout saved none, and its generators start from the
  seed;
* another layout: the masks of the saved run cannot be continued (which rank's stream would a new
  rank take?), so CheckpointError if the saved generators had drawn any mask, unless the caller
  passes ``restore_dropout_rng=False`` and takes new streams from its own seed; generators that
  never drew (dropout 0, or a save before the first step) hold nothing to lose.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from distframe.checkpoint.format import CheckpointError
from distframe.models.base import ShardedModelBase
from distframe.models.hybrid import HybridShardedModel
from distframe.models.sharded_state import RangeReader, piece_key
from distframe.models.tensor_parallel_rng import TensorParallelRNG

KIND = "dropout_rng"
_SEEDS = "seeds"


def layout(model: ShardedModelBase) -> dict[str, int] | None:
    """What the metadata records: the layout whose ranks saved generators, or None."""
    if _generators(model) is None:
        return None
    dims = model.dims
    return {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp, "cp": dims.cp}


def agreed_layout(tables: list[dict[str, Any]]) -> dict[str, int] | None:
    """The layout any rank's file table gives (each rank's ``layout``, taken out of ``tables``),
    or None when no rank saved generators."""
    found = [table.pop(KIND, None) for table in tables]
    return next((layout for layout in found if layout is not None), None)


def pieces(model: ShardedModelBase) -> dict[str, torch.Tensor]:
    """This rank's generator state, as 1-D pieces keyed by its coordinates."""
    rng = _generators(model)
    if rng is None:
        return {}
    where = _coordinates(model)
    return {piece_key(KIND, f"{where}/{entry}", 0): value.reshape(-1)
            for entry, value in rng.state_dict().items()}


def restore(path: Path, meta: dict[str, Any], reader: RangeReader, model: ShardedModelBase, *,
            enabled: bool = True) -> None:
    """This rank's saved generators into ``model``'s (see the module docstring); nothing when not
    ``enabled``. No communication."""
    rng, saved = _generators(model), meta.get("dropout_rng")
    if rng is None or saved is None or not enabled:
        return
    ours = layout(model)
    if saved != ours:
        if any(k.startswith(f"{KIND}/") and not k.endswith(f"/{_SEEDS}@0") for k in reader.keys):
            raise CheckpointError(
                f"{path} holds the dropout generators of a run laid out as "
                f"{_layout(saved)}, but this model is {_layout(ours)}: its masks cannot continue that "
                "run's. Load it with that layout to resume the run exactly, or pass "
                "restore_dropout_rng=False to checkpoint.load to draw new masks from this model's seed")
        return
    where = _coordinates(model)
    state = reader.wholes(KIND, f"{where}/")
    if not state and saved.get("tp") == 1:  # the saved stage had no active dropout: it drew nothing
        return
    if _SEEDS not in state:
        raise CheckpointError(f"{path} lists the dropout generators of layout {_layout(saved)} but holds "
                              f"none for {where}: the checkpoint is incomplete; load an earlier one")
    rng.load_state_dict(state)


def _generators(model: ShardedModelBase) -> TensorParallelRNG | None:
    return model.dropout_rng if isinstance(model, HybridShardedModel) else None


def _coordinates(model: HybridShardedModel) -> str:
    groups = model.groups
    return f"stage{groups.pp_index}.replica{groups.replica_index}.tp{groups.tp_index}"


def _layout(layout: dict[str, int]) -> str:
    return " ".join(f"{axis}={layout[axis]}" for axis in ("dp", "tp", "pp", "cp"))
