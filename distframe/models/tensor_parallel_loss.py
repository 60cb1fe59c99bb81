"""Cross-entropy over vocab-parallel logits, never gathering the ``(..., V)`` tensor.

Rank r holds logits for vocabulary ids ``[r*V/t, (r+1)*V/t)`` (the output of a column-parallel
head without ``gather_output``). Forward: three all-reduces of a ``(...)`` statistic (max, sum of
exponentials, the target's logit). Backward is local: ``softmax - one_hot`` on this rank's ids,
so no communication runs. Equal to ``F.cross_entropy`` on the gathered logits.
"""
from __future__ import annotations

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import ReduceOp


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, backend: ICommunicationBackend):
        vocab_local = logits.shape[-1]
        start = backend.rank * vocab_local
        logits = logits.detach()
        global_max = backend.all_reduce(logits.amax(dim=-1).contiguous(), ReduceOp.MAX)
        shifted = logits - global_max.unsqueeze(-1)  # (..., V/t)
        local_ids = targets - start
        inside = (local_ids >= 0) & (local_ids < vocab_local)
        safe_ids = local_ids.masked_fill(~inside, 0).unsqueeze(-1)
        target_logit = shifted.gather(-1, safe_ids).squeeze(-1).masked_fill(~inside, 0.0)
        target_logit = backend.all_reduce(target_logit.contiguous(), ReduceOp.SUM)
        exp = shifted.exp()
        sum_exp = backend.all_reduce(exp.sum(dim=-1).contiguous(), ReduceOp.SUM)
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, safe_ids, inside)
        return sum_exp.log() - target_logit  # (...) per-token loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, safe_ids, inside = ctx.saved_tensors
        one_hot = torch.zeros_like(softmax).scatter_(-1, safe_ids, inside.unsqueeze(-1).to(softmax.dtype))
        return (softmax - one_hot) * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 backend: ICommunicationBackend, *, reduction: str = "mean",
                                 ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy of vocab-sharded ``logits (..., V/t)`` against global ``targets (...)``.

    ``reduction``: ``"mean"`` (over every target not equal to ``ignore_index``, as
    ``F.cross_entropy``), ``"sum"`` or ``"none"``; ignored targets add no loss and no gradient.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    ignored = targets == ignore_index
    # The masked_fill also zeroes the ignored positions' gradient.
    losses = _VocabParallelCrossEntropy.apply(logits, targets, backend).masked_fill(ignored, 0.0)
    if reduction == "mean":
        return losses.sum() / (~ignored).sum()
    return losses.sum() if reduction == "sum" else losses
