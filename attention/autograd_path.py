"""Dilated attention differentiated by autograd, used when attention dropout is active.

Same branches and merge as ``attention/function.py`` but written with differentiable torch ops
and an explicit ``(M x M)`` score matrix per compressed segment (O(seq * w / r) memory per
branch), so that dropout can be applied to the merged attention probabilities: merged
probabilities are ``sum_i exp(lse_i - LSE) * P_i``, so dropping them is dropping every ``P_i``
with *one* mask and merging: a pair that several branches cover gets one decision, shared
through a hash of the pair (``[Note: one dropout decision per pair]`` in
``attention/pair_dropout.py``).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from attention.function import KeySource, accumulate_dtype
from attention.pair_dropout import draw_seed, unit_keep_mask


def generator_dropout(x: torch.Tensor, p: float, generator: torch.Generator | None, *,
                      inplace: bool = False) -> torch.Tensor:
    """``F.dropout(x, p)`` in training mode, its mask drawn from ``generator`` (torch's global
    generator when None), which must be on ``x``'s device."""
    if p == 0.0:
        return x
    if generator is None:
        return F.dropout(x, p=p, training=True, inplace=inplace)
    if p == 1.0:  # everything dropped (1 - p would divide 0 by 0)
        return x.zero_() if inplace else torch.zeros_like(x)
    keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=generator)  # 1 keeps, 0 drops
    scaled = keep.div_(1.0 - p)
    return x.mul_(scaled) if inplace else x * scaled


def _branch(query, key, value, key_padding_mask, source: KeySource, is_causal, scale, dropout):
    """One unit's output and lse; ``dropout``: None or ``(p, seed, first_head)``."""
    plan = source.plan
    acc = accumulate_dtype(query.dtype)
    qc = plan.compressed(query).to(acc)  # (B*nseg, H, M, D)
    kc, vc, key_mask = source.gather_keys(key, value, key_padding_mask)
    scores = (qc @ kc.to(acc).transpose(-1, -2)) * scale  # (B*nseg, H, M, M)
    if key_mask is not None:
        scores = scores.masked_fill(key_mask[:, :, None, :], float("-inf"))
    if is_causal:
        rows = scores.shape[-1]
        upper = torch.ones(rows, rows, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(upper, float("-inf"))
    lse = _logsumexp(scores, -1)  # (B*nseg, H, M, 1)
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - torch.where(empty, torch.zeros_like(lse), lse))
    if dropout is not None:
        p, seed, first_head = dropout
        probs = probs * unit_keep_mask(plan, query.shape[0], seed, first_head, p)
    attended = probs @ vc.to(acc)  # (B*nseg, hg, M, D)
    if dropout is not None:
        attended = attended * (1.0 / (1.0 - p))  # the kept pairs' 1 / (1 - p)
    out_c = torch.cat([attended, lse], dim=-1)  # (B*nseg, hg, M, D + 1)
    return _scatter(out_c, plan, query.shape)


def _logsumexp(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``logsumexp`` keeping ``dim``, -inf where every entry is -inf (a query row that sees no
    key) with a zero derivative there: torch's gives exp(-inf - -inf) = NaN, which reached every
    second-order gradient (a gradient penalty) through the rows that do see keys."""
    empty = torch.isneginf(x).all(dim, keepdim=True)
    return torch.logsumexp(x.masked_fill(empty, 0.0), dim, keepdim=True).masked_fill(empty, float("-inf"))


def _scatter(src, plan, shape):
    """Valid rows of ``src`` into full ``(B, T, H, D)`` output and ``(B, T, H)`` lse."""
    batch, local_len, heads, head_dim = shape
    full = src.new_zeros(batch, local_len, heads, head_dim + 1)
    full[..., -1] = float("-inf")
    index = plan.local_targets if not plan.regular else plan.gather_index
    rows = src.reshape(batch, -1, head_dim + 1)
    if not plan.regular:
        rows = rows.index_select(1, plan.local_slots)
    full = full.view(batch, -1, head_dim + 1).index_copy(1, index, rows)
    full = full.view(batch, local_len, heads, head_dim + 1)
    return full[..., :-1], full[..., -1]  # (B, T, H, D), (B, T, H)


def dilated_attention_autograd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               sources: Sequence[KeySource], *, is_causal: bool,
                               key_padding_mask: torch.Tensor | None, scale: float,
                               dropout: float, generator: torch.Generator | None = None,
                               first_head: int = 0) -> torch.Tensor:
    """Merged dilated attention ``(B, T, H, D)`` with dropout on the merged attention
    probabilities; the seed of its pair decisions is drawn from ``generator`` (torch's global
    generator when None). ``first_head``: global index of the first head passed in.

    Units (head groups of a branch) cover disjoint rows, so merging over all units at once is
    merging over branches.
    """
    if any(getattr(source, "exchanges", False) for source in sources):  # ring sources: not differentiable
        raise ValueError("attention dropout is not supported on keys exchanged between ranks")
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    pairs = None
    if dropout > 0.0:
        pairs = (dropout, draw_seed(generator, query.device), first_head)
    outs, lses = zip(*(_branch(query, key, value, key_padding_mask, s, is_causal, scale, pairs)
                       for s in sources))
    lse = torch.stack(lses)  # (units, B, T, H)
    total = _logsumexp(lse, 0)
    safe_total = torch.where(torch.isneginf(total), torch.zeros_like(total), total)
    weights = torch.exp(lse - safe_total).unsqueeze(-1)  # (units, B, T, H, 1)
    out = (weights * torch.stack(outs)).sum(0)
    return out.to(query.dtype)
