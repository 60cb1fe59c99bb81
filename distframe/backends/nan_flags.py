"""MIN and MAX of floating tensors that propagate NaN over transports that do not (Gloo, NCCL).

[Note: NaN flags] The contract is NumPy's np.minimum / np.maximum (what the in-memory engine
computes): an element that is NaN on any rank is NaN in the result, on every rank. Gloo compares
with ``<``, so whether a NaN survived depended on where it sat in the reduction order, and NCCL's
float MIN/MAX is not documented to propagate NaN. Neither takes a user-defined op, so the engine
instead reduces, with the same op and in the tensor's own dtype, a buffer twice the size:

    (chunks, 2, per_chunk): [values, NaN replaced by 0 | NaN flags]

A flag is 1 where the element is NaN for MAX and -1 for MIN, 0 elsewhere, so the op that reduces
the values reduces the flags to nonzero exactly where some rank had NaN. The number standing in
for NaN cannot make a wrong answer: where it went in, the flag is set and the result is NaN
whatever the values reduce to; where no flag is set, no NaN was on the wire and every transport
gets MIN and MAX right. reduce_scatter splits dim 0 into one chunk per rank, so each rank's share
of the buffer is its chunk's values and flags together. The cost, paid only by floating MIN/MAX:
twice the bytes on the wire, and a pass over the tensor on either side.
"""
from __future__ import annotations

import torch

from distframe.backends.types import ReduceOp

# The ops whose result depends on how a transport compares NaN.
ORDER_OPS = (ReduceOp.MIN, ReduceOp.MAX)


def needs_nan_flags(tensor: torch.Tensor, op: ReduceOp) -> bool:
    """Whether reducing ``tensor`` with ``op`` goes through :func:`pack_with_nan_flags`."""
    return op in ORDER_OPS and tensor.is_floating_point()


def pack_with_nan_flags(tensor: torch.Tensor, op: ReduceOp, chunks: int = 1) -> torch.Tensor:
    """A new contiguous ``(chunks, 2, per_chunk)`` buffer for reducing ``tensor`` (contiguous, its
    elements split into ``chunks`` equal runs) with ``op``: each run's values with NaN replaced
    by 0, then its NaN flags."""
    runs = tensor.reshape(chunks, tensor.numel() // chunks)
    packed = tensor.new_empty((chunks, 2, runs.shape[1]))
    values, flags = packed[:, 0], packed[:, 1]
    nan = torch.isnan(runs)
    torch.where(nan, runs.new_zeros(()), runs, out=values)
    flags.copy_(nan)
    if op is ReduceOp.MIN:
        flags.neg_()
    return packed


def unpack_with_nan_flags(reduced: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Writes the result that ``reduced`` holds (a reduced :func:`pack_with_nan_flags` buffer of one
    chunk, or one rank's share of a reduce_scatter of one) into ``out`` (contiguous, one element per
    value): the values, NaN where a flag is set. Returns ``out``."""
    values, flags = reduced.view(2, out.numel())
    torch.where(flags != 0, values.new_full((), float("nan")), values, out=out.view(-1))
    return out
