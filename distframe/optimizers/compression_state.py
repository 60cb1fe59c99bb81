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
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from distframe.models.sharded_state import RangeReader, piece_key
from distframe.optimizers.compression import Compressor, PowerSGDCompressor
from distframe.optimizers.compression_residuals import RESIDUAL_KIND, ResidualScale

WARM_Q = "compression.powersgd_q"
OWN_STATE = "compression.{what}.rank{rank}"  # other compressor state (int8's generator), per rank
ITERATION = "compression.iteration"


def compression_pieces(compressor: Compressor, residuals: Mapping[str, torch.Tensor], iteration: int,
                       residual_scale: ResidualScale, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s pieces: its residuals and compressor state; on rank 0 also the state every
    rank holds alike (see [Note: state written once])."""
    tensors = {piece_key(RESIDUAL_KIND.format(rank=rank), name, 0): residual.detach().reshape(-1).clone()
               for name, residual in residuals.items()}
    for key, value in compressor.state_dict().items():
        what, name = key.split("/", 1)
        if what == "powersgd_q":
            if rank == 0:
                tensors[piece_key(WARM_Q, name, 0)] = value.reshape(-1).clone()
        else:
            tensors[piece_key(OWN_STATE.format(what=what, rank=rank), name, 0)] = value.reshape(-1).clone()
    if rank == 0:
        tensors[piece_key(ITERATION, "step", 0)] = torch.tensor([iteration], dtype=torch.int64)
        if residuals:
            residual_scale.save(tensors)
    return tensors


def saved_iteration(reader: RangeReader) -> int | None:
    """The step count saved, or None where none was."""
    return int(reader.read(ITERATION, "step", 0, 1)[0]) if ITERATION in reader.kinds() else None


def load_compressor_state(compressor: Compressor, reader: RangeReader,
                          params: Mapping[str, torch.Tensor], rank: int) -> None:
    """PowerSGD's saved warm starts, or rank ``rank``'s saved compressor state. PowerSGD's are
    replaced whole: a parameter without a saved one (a checkpoint from before ``start_iter``, or
    from another optimizer) starts from none, as a new compressor would, not from the factors of
    the steps the load abandons."""
    if isinstance(compressor, PowerSGDCompressor):
        held = WARM_Q in reader.kinds()
        compressor.load_state_dict({f"powersgd_q/{name}": _saved_warm_start(compressor, reader, name, param)
                                    for name, param in params.items()
                                    if held and reader.holds(WARM_Q, name)
                                    and compressor.compressible(param.shape)})
        return
    loaded = {}
    for key, value in compressor.state_dict().items():
        what, name = key.split("/", 1)
        kind = OWN_STATE.format(what=what, rank=rank)
        if reader.holds(kind, name):
            loaded[key] = reader.read(kind, name, 0, value.numel()).view_as(value).clone()
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
