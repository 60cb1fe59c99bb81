"""What GradientCompressionOptimizer (``compressed.py``) saves beside the wrapped optimizer's
pieces, and how it reads it back: piece kinds, which rank writes each, PowerSGD's warm start.

[Note: state written once] A checkpoint file holds one rank's ``state_dict()``, and a key stored
in several files is read once per file. State that differs between ranks is keyed by rank: the
error-feedback residuals (``compression_residuals``) and a compressor's own (int8's rounding
generator). State that every rank holds alike, PowerSGD's warm-start factors (the mean of the
summed Q), the step count and the loss scale of the residuals, is written by rank 0 alone, as a
model's buffers are. (Written by every rank, the warm start of a checkpoint saved at 2 ranks or
more stood in every file and, read as one whole piece, failed the load.) Every rank of a run of
any size reads rank 0's.

[Note: one rank's state_dict] ``state_dict()`` of any rank also records the step count, the
world size and the loss scale of the residuals (``RECORD``, JSON that a checkpoint keeps from
rank 0), so each rank can load its own state back: the step count was rank 0's alone (rank 1
restarted at step 0), and the world size was taken for the highest rank whose residuals the state
holds (rank 0's own state read as a world of 1, its residuals doubled at 2 ranks). PowerSGD's
warm start is rank 0's alone: a state that lacks the one the saved run had is refused, as the
ranks would start from different factors. Merged states without the record (checkpoints from
before it) are read as before.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from distframe.errors import ConfigError
from distframe.models.sharded_state import RangeReader, piece_key
from distframe.optimizers.compression import Compressor, PowerSGDCompressor
from distframe.optimizers.compression_residuals import RESIDUAL_KIND, ResidualScale, saved_loss_scale

WARM_Q = "compression.powersgd_q"
OWN_STATE = "compression.{what}.rank{rank}"  # other compressor state (int8's generator), per rank
ITERATION = "compression.iteration"
RECORD = "compression"  # state_dict() key of what every rank records alike: [Note: one rank's state_dict]


def compression_pieces(compressor: Compressor, residuals: Mapping[str, torch.Tensor], iteration: int,
                       residual_scale: ResidualScale, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s pieces: its residuals and compressor state; on rank 0 also the state every
    rank holds alike (see [Note: state written once])."""
    tensors = {piece_key(RESIDUAL_KIND.format(rank=rank), name, 0): residual.detach().reshape(-1).clone()
               for name, residual in residuals.items()}
    for key, value in compressor.state_dict().items():
        what, name = _split_key(compressor, key)
        if what == "powersgd_q":
            if rank == 0:
                tensors[piece_key(WARM_Q, name, 0)] = value.reshape(-1).clone()
        else:  # whole, in its shape: the load may have no fresh entry to take the shape from
            tensors[piece_key(OWN_STATE.format(what=what, rank=rank), name, 0)] = value.detach().clone()
    if rank == 0:
        tensors[piece_key(ITERATION, "step", 0)] = torch.tensor([iteration], dtype=torch.int64)
        if residuals:
            residual_scale.save(tensors)
    return tensors


def _split_key(compressor: Compressor, key: str) -> tuple[str, str]:
    """``key`` of ``compressor.state_dict()`` as (what, parameter name); ConfigError off the format."""
    what, slash, name = key.partition("/")
    if not slash or what == "residual":
        raise ConfigError(
            f"{type(compressor).__name__}.state_dict() has the key {key!r}: name each entry "
            "'<what>/<parameter name>' (the key= compress is given), e.g. 'ema/0.weight', or "
            "'<what>/' for state of the whole compressor; 'residual' is the optimizer's own")
    return what, name


def compression_record(compressor: Compressor, residuals: Mapping[str, torch.Tensor], iteration: int,
                       residual_scale: ResidualScale, world_size: int) -> dict[str, Any]:
    """What every rank's ``state_dict()`` records alike (see [Note: one rank's state_dict])."""
    return {"step": iteration, "world_size": world_size,
            "loss_scale": float(residual_scale.scale) if residuals else None,
            "warm_start": isinstance(compressor, PowerSGDCompressor) and bool(compressor.state_dict())}


def saved_record(state: Mapping[str, Any], reader: RangeReader) -> dict[str, Any]:
    """``state``'s record; for a merged state without one, what rank 0's pieces hold (the
    world size then the highest rank whose residuals it holds, plus one: ``load_residuals``)."""
    if isinstance(state.get(RECORD), dict):
        return state[RECORD]
    kinds = reader.kinds()
    return {"step": int(reader.read(ITERATION, "step", 0, 1)[0]) if ITERATION in kinds else None,
            "world_size": None, "loss_scale": saved_loss_scale(reader, kinds), "warm_start": None}


def load_compressor_state(compressor: Compressor, reader: RangeReader,
                          params: Mapping[str, torch.Tensor], rank: int, record: Mapping[str, Any]) -> None:
    """PowerSGD's saved warm starts, or rank ``rank``'s saved compressor state, every entry saved
    (those created as it ran, too). PowerSGD's are replaced whole: a parameter without a saved
    one (a checkpoint from before ``start_iter``, or from another optimizer) starts from none, as a
    new compressor would, not from the factors of the steps the load abandons."""
    if isinstance(compressor, PowerSGDCompressor):
        held = WARM_Q in reader.kinds()
        if record.get("warm_start") and not held:
            raise ConfigError(
                "this state holds no PowerSGD warm-start factors, which the saved run had: rank 0's "
                "state_dict() alone holds them (the same on every rank), and ranks starting from "
                "different factors would diverge; load a distframe checkpoint (checkpoint.save / "
                "checkpoint.load), or on every rank the ranks' state_dict()['tensors'] merged")
        compressor.load_state_dict({f"powersgd_q/{name}": _saved_warm_start(compressor, reader, name, param)
                                    for name, param in params.items()
                                    if held and reader.holds(WARM_Q, name)
                                    and compressor.compressible(param.shape)})
        return
    fresh = compressor.state_dict()
    suffix = f".rank{rank}"  # the kinds OWN_STATE.format(what=..., rank=rank)
    loaded = {}
    for kind in reader.kinds() - {RESIDUAL_KIND.format(rank=rank)}:
        if kind.startswith("compression.") and kind.endswith(suffix):
            what = kind.removeprefix("compression.").removesuffix(suffix)
            for name in reader.names(kind):
                value = reader.whole(kind, name).clone()
                template = fresh.get(f"{what}/{name}")  # (checkpoints of before stored it flat)
                if template is not None and value.numel() == template.numel():
                    value = value.view_as(template)
                loaded[f"{what}/{name}"] = value
    if loaded:
        compressor.load_state_dict(loaded)


def _saved_warm_start(psgd: PowerSGDCompressor, reader: RangeReader, name: str,
                      param: torch.Tensor) -> torch.Tensor:
    """``name``'s saved warm start as ``psgd``'s m x r Q. Saved at another ``rank``, its leading
    columns are kept and the missing ones left zero, which ``warm_start`` replaces by seeded ones
    (see [Note: dead columns])."""
    _, m = psgd.matrix_shape(param.shape)
    saved = reader.whole(WARM_Q, name).reshape(m, -1)  # (m, saved rank)
    q = saved.new_zeros(m, psgd.effective_rank(param.shape))
    kept = min(q.shape[1], saved.shape[1])
    q[:, :kept] = saved[:, :kept]
    return q
