"""Elementwise reduction of equally shaped tensors, shared by engines that reduce in Python."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from distframe.backends.types import ReduceOp
from distframe.backends.validation import dense

LOW_PRECISION = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16 and bfloat16 are reduced in float32 and rounded once at the end."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def work_tensor(tensor: torch.Tensor, op: ReduceOp | None, world_size: int = 1,
                keep_dtype: bool = False) -> torch.Tensor:
    """What the engine reduces with ``op`` (None: moves) for ``tensor``: itself when contiguous,
    else a contiguous copy. For AVG of float16/bfloat16, and ``average_`` after the SUM:

    - engines that reduce in Python (in-memory, MPI) get a float32 copy and the mean is rounded
      once: a sum rounded to the dtype first is rounded twice, and float16 values near its
      largest (65504) overflow in their sum but not in their mean;
    - engines that move the tensor's own dtype (``keep_dtype``: Gloo, NCCL) keep it, so half
      precision costs half the bytes of float32 on the wire, as torch DDP's and FSDP's do.
      float16 is first divided by ``p``, the power of two >= ``world_size``, so the sum cannot
      overflow; ``average_`` scales it by ``p / world_size`` in float32. The division is exact
      for magnitudes of at least 2**-14 * p; below that the quotient is subnormal and loses bits
      (a value under 2**-24 * p becomes 0), as torch DDP's division of float16 buckets does:
      train float16 with loss scaling, which keeps gradients far above that range.

    torch cannot divide complex32, so every engine averages a complex64 copy of it.
    """
    if op is ReduceOp.AVG and tensor.dtype == torch.complex32:
        return tensor.to(torch.complex64, memory_format=torch.contiguous_format)
    if op is ReduceOp.AVG and tensor.dtype in LOW_PRECISION:
        if not keep_dtype:
            return tensor.to(accumulation_dtype(tensor.dtype), memory_format=torch.contiguous_format)
        if tensor.dtype == torch.float16:
            return tensor.div(power_of_two_at_least(world_size)).contiguous()
    return dense(tensor)  # written back with copy_result


def copy_result(data: torch.Tensor, work: torch.Tensor) -> None:
    """Copies ``work_tensor``'s result into ``data``. Cast to ``data``'s dtype first: torch's
    ``copy_`` respects a neg bit (``x.conj().imag`` of complex32) within one dtype, but a float32
    to float16 ``copy_`` wrote the value as if the bit were clear, negating the mean."""
    data.copy_(work if work.dtype == data.dtype else work.to(data.dtype))


def average_(work: torch.Tensor, world_size: int, keep_dtype: bool = False) -> torch.Tensor:
    """The mean, in place, from the SUM of the tensors ``work_tensor`` made with the same
    arguments."""
    if keep_dtype and work.dtype == torch.float16:
        scale = power_of_two_at_least(world_size)
        if scale != world_size:
            work.copy_(work.float().mul_(scale).div_(world_size))
        return work
    return work.div_(world_size)


def power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


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
