"""Cross-entropy over vocab-parallel logits, never gathering the ``(..., V)`` tensor.

Rank r holds logits for vocabulary ids ``[r*V/t, (r+1)*V/t)`` (the output of a column-parallel
head without ``gather_output``). Forward: three all-reduces of a ``(...)`` statistic (max, sum of
exponentials, the target's logit). Backward is local: ``softmax - one_hot`` on this rank's ids,
so no communication runs. Equal to ``F.cross_entropy`` on the gathered logits.

float16/bfloat16 logits are computed in float32, as ``F.cross_entropy`` and Megatron do: the
statistics (and their all-reduces), the reduction over tokens and the gradient, each rounded once
to the logits' dtype at the end. In half precision a sum of exponentials over a large vocabulary
is rounded to 8 or 11 bits and overflows float16 past 65504 (the loss becomes inf).
"""
from __future__ import annotations

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import ReduceOp


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float16/bfloat16 logits, else their own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses in ``compute_dtype(logits.dtype)``; the gradient in the logits' dtype.

    [Note: differentiable once] The forward's statistics come from all-reduces autograd does not
    see, so no second derivative (``create_graph=True``: a gradient penalty, a Hessian-vector
    product) could be right; backward recorded in place raised an obscure 'modified by an inplace
    operation' instead. Backward runs unrecorded (as ``once_differentiable``), so the first
    derivative is exact under ``create_graph=True`` too; there the gradient goes through
    ``_DifferentiatedTwice``, which keeps it attached to the logits (and to the incoming gradient)
    and raises when a second derivative reaches it. ``once_differentiable`` alone does not do that
    for the usual loss: the gradient a mean passes in does not require grad, so it returned a
    constant, and the second-order terms through the loss were dropped, silently.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, backend: ICommunicationBackend):
        vocab_local = logits.shape[-1]
        start = backend.rank * vocab_local
        upcast = logits.detach().to(compute_dtype(logits.dtype))
        global_max = backend.all_reduce(upcast.amax(dim=-1).contiguous(), ReduceOp.MAX)
        shifted = upcast - global_max.unsqueeze(-1)  # (..., V/t)
        local_ids = targets - start
        inside = (local_ids >= 0) & (local_ids < vocab_local)
        safe_ids = local_ids.masked_fill(~inside, 0).unsqueeze(-1)
        target_logit = shifted.gather(-1, safe_ids).squeeze(-1).masked_fill(~inside, 0.0)
        target_logit = backend.all_reduce(target_logit.contiguous(), ReduceOp.SUM)
        sum_exp = backend.all_reduce(shifted.exp_().sum(dim=-1).contiguous(), ReduceOp.SUM)
        # The logits (as given: no upcast copy kept) and two (...) statistics; backward recomputes
        # the softmax from them in the compute dtype.
        ctx.save_for_backward(logits, global_max, sum_exp, safe_ids, inside)
        return sum_exp.log() - target_logit  # (...) per-token loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, global_max, sum_exp, safe_ids, inside = ctx.saved_tensors
        with torch.no_grad():  # see [Note: differentiable once]
            softmax = (logits.to(global_max.dtype) - global_max.unsqueeze(-1)).exp_()
            softmax.div_(sum_exp.unsqueeze(-1))
            softmax.scatter_add_(-1, safe_ids, -inside.unsqueeze(-1).to(softmax.dtype))  # - one_hot
            gradient = softmax.mul_(grad.unsqueeze(-1)).to(logits.dtype)
        if torch.is_grad_enabled():  # backward with create_graph=True
            gradient = _DifferentiatedTwice.apply(gradient, logits, grad)
        return gradient, None, None


class _DifferentiatedTwice(torch.autograd.Function):
    """The loss's gradient as given; its backward raises ([Note: differentiable once])."""

    @staticmethod
    def forward(ctx, gradient: torch.Tensor, logits: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return gradient.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise RuntimeError(
            "vocab_parallel_cross_entropy cannot be differentiated twice: its statistics come from "
            "all-reduces that autograd does not see, so a second derivative through it (a gradient "
            "penalty, a Hessian-vector product) would be wrong. Take the second derivative of "
            "another loss, or gather the logits and use F.cross_entropy")


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 backend: ICommunicationBackend, *, reduction: str = "mean",
                                 ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy of vocab-sharded ``logits (..., V/t)`` against global ``targets (...)``.

    ``reduction``: ``"mean"`` (over every target not equal to ``ignore_index``, as
    ``F.cross_entropy``), ``"sum"`` or ``"none"``; ignored targets add no loss and no gradient.
    The loss has the logits' dtype; half-precision logits are computed in float32. A target
    outside ``[0, V)`` other than ``ignore_index`` raises IndexError, as ``F.cross_entropy`` does
    (see [Note: target check]).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    ignored = targets == ignore_index
    _check_targets(logits, targets, ignored, backend.world_size)
    # The masked_fill also zeroes the ignored positions' gradient.
    losses = _VocabParallelCrossEntropy.apply(logits, targets, backend).masked_fill(ignored, 0.0)
    if reduction == "mean":
        losses = losses.sum() / (~ignored).sum()
    elif reduction == "sum":
        losses = losses.sum()
    return losses.to(logits.dtype)  # reduced in the compute dtype, rounded once


def _check_targets(logits: torch.Tensor, targets: torch.Tensor, ignored: torch.Tensor, ranks: int) -> None:
    """ValueError for targets that are not class ids of the logits' shape without the vocabulary
    dim; IndexError naming their range for an id outside the vocabulary.

    [Note: target check] A target no rank holds would be scored against a target logit of 0 on
    every rank (the loss logsumexp, the gradient softmax): a silently wrong loss where
    ``F.cross_entropy`` raises. Targets of a shape ``gather`` accepts but that is not
    ``logits.shape[:-1]`` (``(B, 1)`` against ``(B, T, V/t)``) broadcast into a wrong loss. Every
    rank of the tensor group holds the same targets, so each raises alike before the first
    all-reduce; the id check costs one ``aminmax`` and a host sync, as the embedding's does.
    """
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"vocab_parallel_cross_entropy takes integer class ids as targets, got "
                         f"{targets.dtype} (class-probability targets are not supported)")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets of shape {tuple(targets.shape)} do not match logits of shape "
                         f"{tuple(logits.shape)}: give one class id per position, of shape "
                         f"{tuple(logits.shape[:-1])}")
    if targets.numel() == 0:
        return
    vocab_size = logits.shape[-1] * ranks
    lowest, highest = torch.stack(torch.aminmax(targets.masked_fill(ignored, 0))).tolist()
    if lowest < 0 or highest >= vocab_size:
        raise IndexError(f"vocab_parallel_cross_entropy got target ids in [{lowest}, {highest}], outside "
                         f"its vocabulary of {vocab_size} (valid ids: 0 to {vocab_size - 1}, or "
                         "ignore_index to skip a position)")
