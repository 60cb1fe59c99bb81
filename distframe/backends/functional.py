"""Differentiable collectives over any backend, and the Megatron conjugate regions.

Each function is an autograd Function whose backward runs the adjoint collective on the same
backend: all_gather <-> reduce_scatter, all_reduce(SUM) <-> all_reduce(SUM), all_to_all <->
all_to_all in reverse. Every rank of the group must run the backward (they communicate), as
with torch.distributed.nn.functional. The backward runs the adjoint through these Functions, not
the backend's plain call, so it is differentiable in turn: second derivatives (a gradient
penalty, a Hessian-vector product) are exact with ``create_graph=True``; a plain call there
dropped the collective's part of them without a word.

Megatron's tensor-parallel regions (Shoeybi et al., 2019), named by what they do to activations:
``copy_to_parallel_region`` (forward identity, backward all-reduce: the f operator),
``reduce_from_parallel_region`` (forward all-reduce, backward identity: g),
``scatter_to_parallel_region`` (forward keep this rank's slice of the last dim, backward
all-gather it) and ``gather_from_parallel_region`` (forward all-gather the last dim, backward
keep this rank's slice).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import ReduceOp

__all__ = [
    "all_gather", "all_reduce", "all_to_all", "copy_to_parallel_region", "gather_from_parallel_region",
    "reduce_from_parallel_region", "reduce_scatter", "scatter_to_parallel_region",
]


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
        ctx.backend = backend
        return backend.all_gather(tensor.contiguous())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _ReduceScatter.apply(grad, ctx.backend), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
        ctx.backend = backend
        return backend.reduce_scatter(tensor.contiguous(), ReduceOp.SUM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllGather.apply(grad, ctx.backend), None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, backend: ICommunicationBackend, op: ReduceOp) -> torch.Tensor:
        ctx.backend, ctx.op = backend, op
        return backend.all_reduce(tensor.clone(memory_format=torch.contiguous_format), op)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # d/dx_r of sum_k x_k is the identity for every r, so the gradient is the sum of the
        # cotangents of every rank's output (divided by n for AVG).
        return _AllReduce.apply(grad, ctx.backend, ctx.op), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend: ICommunicationBackend, *chunks: torch.Tensor):
        ctx.backend = backend
        return tuple(backend.all_to_all([c.contiguous() for c in chunks]))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        # Output j came from rank j's chunk for us, so its cotangent goes back to rank j.
        return (None, *_AllToAll.apply(ctx.backend, *grads))


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
        ctx.backend = backend
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _ReduceFromParallel.apply(grad, ctx.backend), None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
        ctx.backend = backend
        return backend.all_reduce(tensor.clone(memory_format=torch.contiguous_format))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Identity, as f (its conjugate), whose backward all-reduces: right for second derivatives.
        return _CopyToParallel.apply(grad, ctx.backend), None


class _ScatterToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
        ctx.backend = backend
        return _last_dim_slice(tensor, backend).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _GatherFromParallel.apply(grad, ctx.backend), None


class _GatherFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
        ctx.backend = backend
        return _gather_last_dim(tensor, backend)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _ScatterToParallel.apply(grad, ctx.backend), None


def _last_dim_slice(tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
    size = tensor.shape[-1]
    if size % backend.world_size:
        raise ValueError(f"the last dim ({size}) must be divisible by the group size {backend.world_size}")
    return tensor.chunk(backend.world_size, dim=-1)[backend.rank]


def _gather_last_dim(tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
    # all_gather concatenates along dim 0; move the last dim to the front and back.
    moved = tensor.movedim(-1, 0).contiguous()
    return backend.all_gather(moved).movedim(0, -1).contiguous()


def all_gather(tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
    """Concatenation of every rank's tensor along dim 0; backward reduce-scatters the gradient."""
    return _AllGather.apply(tensor, backend)


def reduce_scatter(tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
    """Sum over ranks, chunk ``rank`` of dim 0; backward all-gathers the gradient."""
    return _ReduceScatter.apply(tensor, backend)


def all_reduce(tensor: torch.Tensor, backend: ICommunicationBackend,
               op: ReduceOp | str = ReduceOp.SUM) -> torch.Tensor:
    """Out-of-place SUM or AVG over ranks; backward all-reduces the gradient with the same op."""
    op = ReduceOp.parse(op)
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"differentiable all_reduce supports SUM and AVG, not {op.name}")
    return _AllReduce.apply(tensor, backend, op)


def all_to_all(chunks: Sequence[torch.Tensor], backend: ICommunicationBackend) -> list[torch.Tensor]:
    """Chunk j goes to rank j; backward sends each gradient back where its chunk came from."""
    return list(_AllToAll.apply(backend, *chunks))


def copy_to_parallel_region(tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
    """Megatron f: identity forward, all-reduce backward (before a column-parallel layer)."""
    return _CopyToParallel.apply(tensor, backend)


def reduce_from_parallel_region(tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
    """Megatron g: all-reduce forward, identity backward (after a row-parallel layer)."""
    return _ReduceFromParallel.apply(tensor, backend)


def scatter_to_parallel_region(tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
    """Keep this rank's slice of the last dim; backward all-gathers the gradient."""
    return _ScatterToParallel.apply(tensor, backend)


def gather_from_parallel_region(tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
    """All-gather along the last dim; backward keeps this rank's slice of the gradient."""
    return _GatherFromParallel.apply(tensor, backend)
