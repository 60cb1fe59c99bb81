"""Elementwise reduction of equally shaped tensors, shared by engines that reduce in Python."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from distframe.backends.types import ReduceOp

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16 and bfloat16 are reduced in float32 and rounded once at the end."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def reduce_into(out: torch.Tensor, tensors: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Write ``op`` over ``tensors`` (left fold in the given order, so every caller that passes the
    same tensors in the same order gets the same bits) into ``out``. ``op`` is SUM, PRODUCT, MIN or
    MAX (AVG and bool ops are translated by the caller). ``out`` may be ``tensors[0]`` itself (the
    cheapest: no temporary, one pass per input) but must not alias any other input."""
    if not tensors:
        raise ValueError("reduce_into needs at least one tensor")
    acc_dtype = accumulation_dtype(out.dtype)
    if acc_dtype != out.dtype:
        acc = tensors[0].to(acc_dtype)
        for t in tensors[1:]:
            _combine_(acc, t.to(acc_dtype), op)
        out.copy_(acc)
        return out
    if out is not tensors[0]:
        out.copy_(tensors[0])
    for t in tensors[1:]:
        _combine_(out, t, op)
    return out


def _combine_(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> None:
    if op is ReduceOp.SUM:
        if acc.dtype == torch.bool:
            acc.logical_or_(other)
        else:
            acc.add_(other)
    elif op is ReduceOp.PRODUCT:
        if acc.dtype == torch.bool:
            acc.logical_and_(other)
        else:
            acc.mul_(other)
    elif op is ReduceOp.MIN:
        torch.minimum(acc, other, out=acc)
    elif op is ReduceOp.MAX:
        torch.maximum(acc, other, out=acc)
    else:
        raise ValueError(f"reduce_into cannot apply {op}; AVG is SUM followed by a division")
