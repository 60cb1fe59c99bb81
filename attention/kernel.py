"""Segment attention kernel: ``(q, k, v) -> (out, lse)`` and its backward.

Inputs are batches of compressed (dilated) segments ``(N, H, M, D)``. The forward returns the
log-sum-exp of every row so that branches can be merged by their softmax denominators; the
backward takes the *merged* output and log-sum-exp (see ``[Note: merged backward]`` in
``attention/function.py``). On CPU this calls torch's fused flash kernel, which never builds an
``M x M`` score matrix in memory; elsewhere it falls back to a plain math kernel over the
(short) compressed segments.

``key_mask`` is ``(N, H, M)`` bool, True marking a key that must be ignored. Rows that see no
key at all return ``out = 0`` and ``lse = -inf``.
"""
from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def _additive_mask(key_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if key_mask is None:
        return None
    mask = torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device)
    return mask.masked_fill_(key_mask, _NEG_INF).unsqueeze(2)  # (N, H, 1, M)


def rows_without_keys(key_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor | None:
    """``(N, H, M)`` bool: rows for which every key they may see is masked (None: no such rows)."""
    if key_mask is None:
        return None
    present = (~key_mask).to(torch.int32)
    if is_causal:
        return present.cumsum(-1) == 0
    return (present.sum(-1, keepdim=True) == 0).expand_as(key_mask)


def _use_cpu_flash(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64,
                                                  torch.bfloat16, torch.float16)


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (exact on every device); everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _masked_scores(q, k, is_causal, key_mask, scale):
    """``scale * q k^T`` in fp32 (fp64 for fp64 inputs) with masked and (if causal) future keys
    at -inf: (N, H, M, M)."""
    acc = accumulate_dtype(q.dtype)
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    if key_mask is not None:
        scores = scores.masked_fill(key_mask[:, :, None, :], _NEG_INF)
    if is_causal:
        m = q.shape[-2]
        upper = torch.ones(m, m, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(upper, _NEG_INF)
    return scores


def _math_forward(q, k, v, is_causal, key_mask, scale):
    scores = _masked_scores(q, k, is_causal, key_mask, scale)  # (N, H, M, M)
    lse = torch.logsumexp(scores, dim=-1)  # (N, H, M)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (probs @ v.to(probs.dtype)).to(q.dtype), lse


def segment_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                              is_causal: bool, key_mask: torch.Tensor | None,
                              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over each compressed segment. Returns ``out (N, H, M, D)``, ``lse (N, H, M)`` fp32+."""
    if not _use_cpu_flash(q):
        return _math_forward(q, k, v, is_causal, key_mask, scale)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=_additive_mask(key_mask, q.dtype), scale=scale)
    empty = rows_without_keys(key_mask, is_causal)
    if empty is not None:
        # The fused kernel reports lse = 0 for a row with no key; the definition says -inf.
        lse = lse.masked_fill(empty, _NEG_INF)
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse


def _math_backward(grad_out, q, k, v, out, lse, is_causal, key_mask, scale):
    acc = accumulate_dtype(q.dtype)
    qf, kf, vf, gf = q.to(acc), k.to(acc), v.to(acc), grad_out.to(acc)
    scores = _masked_scores(q, k, is_causal, key_mask, scale)  # (N, H, M, M)
    probs = torch.exp(scores - lse.to(acc).unsqueeze(-1))
    delta = (gf * out.to(acc)).sum(-1, keepdim=True)  # (N, H, M, 1)
    dscores = probs * (gf @ vf.transpose(-1, -2) - delta) * scale
    dq, dk, dv = dscores @ kf, dscores.transpose(-1, -2) @ qf, probs.transpose(-1, -2) @ gf
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def segment_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                               v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *,
                               is_causal: bool, key_mask: torch.Tensor | None,
                               scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one segment batch given the merged ``out`` and ``lse`` of its rows.

    A row with ``lse = +inf`` contributes nothing (its probabilities are all zero).
    """
    if not _use_cpu_flash(q):
        return _math_backward(grad_out, q, k, v, out, lse, is_causal, key_mask, scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, is_causal,
        attn_mask=_additive_mask(key_mask, q.dtype), scale=scale)
