"""Differentiable collectives over any backend, and the Megatron conjugate regions.

The collectives are autograd Functions whose backward runs the adjoint collective on the same
backend: all_gather <-> reduce_scatter, all_reduce(SUM) <-> all_reduce(SUM), all_to_all <->
all_to_all in reverse. Every rank of the group must run the backward (they communicate), as
with torch.distributed.nn.functional. The backward runs the adjoint through these Functions, not
the backend's plain call, so it is differentiable in turn: second derivatives (a gradient
penalty, a Hessian-vector product) are exact with ``create_graph=True``; a plain call there
dropped the collective's part of them without a word.

[Note: ranks that disagree about autograd] A rank whose input does not require grad (a frozen
tensor, ``torch.no_grad``) records no backward, so the others' backward collective paired with
whatever it called next: a plain all_reduce of the same shape, and both ranks' gradients came
out wrong without a word. Every call these functions make is therefore tagged
(``composed.tagged_calls``) with its pass: the forward of which function, where a backward is
to come (one that records nothing is a plain call), or the backward of which function (and
whether it records for a second derivative). Where an engine compares signatures (in-memory
always, Gloo and MPI ranks on one node, every rank with ``debug=True``) ranks that disagree
raise CollectiveMismatchError at the forward, and a backward's collective never pairs with a
plain call; elsewhere the rule stands unchecked.

Megatron's tensor-parallel regions (Shoeybi et al., 2019), named by what they do to activations
(their backward is the adjoint only when the cotangent is the same on every rank of the group,
as it is inside a tensor-parallel layer, whose output every rank holds whole):
``copy_to_parallel_region`` (forward identity, backward all-reduce: the f operator),
``reduce_from_parallel_region`` (forward all-reduce, backward identity: g),
``scatter_to_parallel_region`` (forward keep this rank's slice of the last dim, backward
all-gather it) and ``gather_from_parallel_region`` (forward all-gather the last dim, backward
keep this rank's slice).
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from distframe.backends.composed import tagged_calls
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
        with _pass("backward of all_gather", grad):
            return _ReduceScatter.apply(grad, ctx.backend), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
        ctx.backend = backend
        return backend.reduce_scatter(tensor.contiguous(), ReduceOp.SUM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with _pass("backward of reduce_scatter", grad):
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
        with _pass("backward of all_reduce", grad):
            return _AllReduce.apply(grad, ctx.backend, ctx.op), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend: ICommunicationBackend, *chunks: torch.Tensor):
        ctx.backend = backend
        # Gloo and MPI return views of one receive buffer: autograd refuses an in-place op on
        # one view of a Function's several outputs, which the in-memory engine's separate
        # tensors allowed. Separate them, so code behaves the same on every engine.
        return tuple(o.clone() if o._base is not None else o
                     for o in backend.all_to_all([c.contiguous() for c in chunks]))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        # Output j came from rank j's chunk for us, so its cotangent goes back to rank j.
        with _pass("backward of all_to_all", *grads):
            return (None, *_AllToAll.apply(ctx.backend, *grads))


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
        ctx.backend = backend
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with _pass("backward of copy_to_parallel_region", grad):
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
        with _pass("backward of scatter_to_parallel_region", grad):
            return _GatherFromParallel.apply(grad, ctx.backend), None


class _GatherFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
        ctx.backend = backend
        return _gather_last_dim(tensor, backend)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _ScatterToParallel.apply(grad, ctx.backend), None


def _pass(name: str, *tensors: torch.Tensor) -> contextlib.AbstractContextManager[None]:
    """Tags the calls made inside with the autograd pass ``name`` (a function's name: its forward;
    "backward of ...") and whether it records a backward of its own ([Note: ranks that disagree
    about autograd]). A forward that records nothing is a plain call and goes untagged."""
    records = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if not records and not name.startswith("backward"):
        return contextlib.nullcontext()
    return tagged_calls(("autograd", f"{name}{', recording a backward' if records else ''}"))


def _forward(name: str, backend: ICommunicationBackend | None,
             *tensors: torch.Tensor) -> contextlib.AbstractContextManager[None]:
    """``_pass(name, *tensors)`` once ``backend`` is a group: ``new_group`` gives None to the
    ranks outside it, which failed with "'NoneType' object has no attribute 'all_gather'"."""
    if backend is None:
        raise ValueError(f"{name}: the backend is None, which new_group returns on ranks outside the "
                         "group; call it on the group's members only (if group is not None: ...)")
    return _pass(name, *tensors)


def _last_dim_slice(tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
    if tensor.dim() == 0:
        raise ValueError("scatter_to_parallel_region splits the last dim: pass a tensor with at least "
                         "one dim, not a 0-dim one")
    size = tensor.shape[-1]
    if size % backend.world_size:
        raise ValueError(f"the last dim ({size}) must be divisible by the group size {backend.world_size}")
    return tensor.chunk(backend.world_size, dim=-1)[backend.rank]


def _gather_last_dim(tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
    # all_gather concatenates along dim 0; move the last dim to the front and back.
    moved = tensor.movedim(-1, 0).contiguous()
    # A new tensor, never a view: where the moved-back gather is contiguous already (one row, a
    # 1-d input), contiguous() returned a view made inside the autograd Function, and an in-place
    # op after it (nn.ReLU(inplace=True) after a gathered column layer) raised.
    return backend.all_gather(moved).movedim(0, -1).clone(memory_format=torch.contiguous_format)


def all_gather(tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
    """Concatenation of every rank's tensor along dim 0; backward reduce-scatters the gradient."""
    with _forward("all_gather", backend, tensor):
        return _AllGather.apply(tensor, backend)


def reduce_scatter(tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
    """Sum over ranks, chunk ``rank`` of dim 0; backward all-gathers the gradient."""
    with _forward("reduce_scatter", backend, tensor):
        return _ReduceScatter.apply(tensor, backend)


def all_reduce(tensor: torch.Tensor, backend: ICommunicationBackend,
               op: ReduceOp | str = ReduceOp.SUM) -> torch.Tensor:
    """Out-of-place SUM or AVG over ranks; backward all-reduces the gradient with the same op."""
    op = ReduceOp.parse(op)
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"differentiable all_reduce supports SUM and AVG, not {op.name}")
    with _forward("all_reduce", backend, tensor):
        return _AllReduce.apply(tensor, backend, op)


def all_to_all(chunks: Sequence[torch.Tensor], backend: ICommunicationBackend) -> list[torch.Tensor]:
    """Chunk j goes to rank j; backward sends each gradient back where its chunk came from."""
    with _forward("all_to_all", backend, *chunks):
        return list(_AllToAll.apply(backend, *chunks))


def copy_to_parallel_region(tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
    """Megatron f: identity forward, all-reduce backward (before a column-parallel layer)."""
    with _forward("copy_to_parallel_region", backend, tensor):
        return _CopyToParallel.apply(tensor, backend)


def reduce_from_parallel_region(tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
    """Megatron g: all-reduce forward, identity backward (after a row-parallel layer)."""
    with _forward("reduce_from_parallel_region", backend, tensor):
        return _ReduceFromParallel.apply(tensor, backend)


def scatter_to_parallel_region(tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
    """Keep this rank's slice of the last dim; backward all-gathers the gradient."""
    with _forward("scatter_to_parallel_region", backend, tensor):
        return _ScatterToParallel.apply(tensor, backend)


def gather_from_parallel_region(tensor: torch.Tensor, backend: ICommunicationBackend) -> torch.Tensor:
    """All-gather along the last dim; backward keeps this rank's slice of the gradient."""
    with _forward("gather_from_parallel_region", backend, tensor):
        return _GatherFromParallel.apply(tensor, backend)
