"""What the torch.distributed transports (Gloo, NCCL) can carry, and views that make the rest fit.

Both transports move and reduce float64, float32, float16, bfloat16, int64, int32, int8, uint8 and
bool natively. Anything else is moved as its raw bytes (a zero-copy ``uint8`` view) and reduced in
a dtype the transport has: int16 in int32 (wrap-around is the same modulo 2**16), complex SUM as
its real and imaginary parts. A reduction that has no such form (complex PRODUCT) returns None
here, and the engine composes it from an all-gather and a local reduction.

Every function takes a contiguous tensor; the views share its memory.
"""
from __future__ import annotations

import torch

from distframe.backends.types import ReduceOp

NATIVE_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16,
                           torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool})


def movable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or a flat view of its bytes when the transport lacks its dtype."""
    if tensor.dtype in NATIVE_DTYPES:
        return tensor
    flat = tensor.reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        # torch calls a tensor of 0 or 1 elements contiguous whatever its stride (``t[::2]`` of a
        # 2-element one), and ``view(uint8)`` refuses a stride other than 1: the same element
        # under stride 1 (Gloo failed with "must be 1 to view Short as Byte").
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def movable_flat(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A flat movable view and how many of its elements make up one row (one index of dim 0)."""
    per_row = _row_numel(tensor) * (1 if tensor.dtype in NATIVE_DTYPES else tensor.element_size())
    return movable(tensor.reshape(-1)), per_row


def to_reducible(tensor: torch.Tensor, op: ReduceOp) -> tuple[torch.Tensor, bool] | None:
    """``(wire, shares_memory)``: what to hand the transport to reduce ``tensor`` with ``op``.

    ``shares_memory`` is False when ``wire`` is a converted copy, which the caller writes back with
    :func:`from_reducible`. None when the transport cannot reduce this dtype with this op.
    """
    dtype = tensor.dtype
    if dtype == torch.bool:
        # bool arrives as MAX (logical or) or MIN (logical and); as bytes 0/1 these are exact.
        return tensor.view(torch.uint8), True
    if dtype in NATIVE_DTYPES:
        return tensor, True
    if dtype == torch.int16:
        return tensor.to(torch.int32), False
    if dtype.is_complex and op is ReduceOp.SUM:
        return torch.view_as_real(tensor), True
    return None


def from_reducible(wire: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`to_reducible` for a result the transport produced in ``wire``'s dtype."""
    if dtype == torch.bool:
        return wire.view(torch.bool)
    if dtype.is_complex:
        return torch.view_as_complex(wire)
    return wire if wire.dtype == dtype else wire.to(dtype)


def _row_numel(tensor: torch.Tensor) -> int:
    n = 1
    for d in tensor.shape[1:]:
        n *= d
    return n
