"""Dilated attention differentiated by autograd, used when attention dropout is active.

Same branches and merge as ``attention/function.py`` but written with differentiable torch ops
and an explicit ``(M x M)`` score matrix per compressed segment (O(seq * w / r) memory per
branch), so that dropout can be applied to the merged attention probabilities: merged
probabilities are ``exp(lse_i - LSE) * P_i``, so dropping them is dropping ``P_i`` and merging.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from attention.function import KeySource, accumulate_dtype, gather_slots


def _branch(query, key, value, key_padding_mask, source: KeySource, is_causal, scale, dropout):
    plan = source.plan
    acc = accumulate_dtype(query.dtype)
    qc = gather_slots(query, plan).to(acc)  # (B*nseg, H, M, D)
    kc, vc, key_mask = source.gather_keys(key, value, key_padding_mask)
    scores = (qc @ kc.to(acc).transpose(-1, -2)) * scale  # (B*nseg, H, M, M)
    if key_mask is not None:
        scores = scores.masked_fill(key_mask[:, :, None, :], float("-inf"))
    if is_causal:
        rows = scores.shape[-1]
        upper = torch.ones(rows, rows, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(upper, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (B*nseg, H, M, 1)
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - torch.where(empty, torch.zeros_like(lse), lse))
    probs = F.dropout(probs, p=dropout, training=dropout > 0.0)
    out_c = torch.cat([probs @ vc.to(acc), lse], dim=-1)  # (B*nseg, H, M, D + 1)
    return _scatter(out_c, plan, query.shape)


def _scatter(src, plan, shape):
    batch, local_len, heads, _ = shape
    width = src.shape[-1]
    flat = src.reshape(batch, -1, width)
    if plan.all_slots_local:
        targets = plan.gather_index
    else:
        targets = plan.local_targets
        flat = flat.index_select(1, plan.local_slots)
    full = flat.new_zeros(batch, local_len * heads, width)
    covered = flat.new_zeros(batch, local_len * heads, 1)
    full = full.index_add(1, targets, flat)
    covered = covered.index_add(1, targets, torch.ones_like(flat[..., :1]))
    full = full.view(batch, local_len, heads, width)
    lse = full[..., -1].masked_fill(covered.view(batch, local_len, heads) == 0, float("-inf"))
    return full[..., :-1], lse  # (B, T, H, D), (B, T, H)


def dilated_attention_autograd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               sources: Sequence[KeySource], *, is_causal: bool,
                               key_padding_mask: torch.Tensor | None, scale: float,
                               dropout: float) -> torch.Tensor:
    """Merged dilated attention ``(B, T, H, D)`` with dropout on the attention probabilities."""
    outs, lses = zip(*(_branch(query, key, value, key_padding_mask, s, is_causal, scale, dropout)
                       for s in sources))
    lse = torch.stack(lses)  # (branches, B, T, H)
    total = torch.logsumexp(lse, dim=0, keepdim=True)
    safe_total = torch.where(torch.isneginf(total), torch.zeros_like(total), total)
    weights = torch.exp(lse - safe_total).unsqueeze(-1)  # (branches, B, T, H, 1)
    out = (weights * torch.stack(outs)).sum(0)
    return out.to(query.dtype)
