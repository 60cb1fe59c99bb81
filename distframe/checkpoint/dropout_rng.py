"""The tensor-parallel dropout generators (``TensorParallelRNG``) in a checkpoint.

Each rank of a model with ``tp > 1`` saves its generators' ``state_dict()`` as pieces
``dropout_rng/stage<p>.replica<r>.tp<t>/<entry>@0`` (its pipeline stage, data-parallel x context
replica and tensor rank; ``<entry>`` is ``seeds`` or ``<region>.<device type>``), and the
metadata records the layout, ``{"dp", "tp", "pp", "cp"}``, under ``dropout_rng``. A load into a
model of the same layout gives each rank its own generators back, so the resumed run draws the
uninterrupted run's masks. Other cases:

* a checkpoint without them (saved before distframe kept them, or by a model without tensor
  parallelism): the model keeps its own generators, from its seed;
* a model without tensor parallelism: nothing to restore (plain ``nn.Dropout`` draws from torch's
  global generator, which no checkpoint holds);
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
                f"{path} holds the dropout generators of a tensor-parallel run laid out as "
                f"{_layout(saved)}, but this model is {_layout(ours)}: its masks cannot continue that "
                "run's. Load it with that layout to resume the run exactly, or pass "
                "restore_dropout_rng=False to checkpoint.load to draw new masks from this model's seed")
        return
    where = _coordinates(model)
    state = reader.wholes(KIND, f"{where}/")
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
