"""Dense reference for dilated attention: ``softmax(scale * Q K^T + log C) V``.

This is the definition every fast implementation in this package is tested against. It builds
the full ``(heads, seq, seq)`` count matrix ``C``, so it is O(seq^2) in time and memory and is
meant for tests and small checks only.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from attention.pair_dropout import keep_pairs, key_words, row_words


def head_offsets(num_heads: int, dilation_rate: int) -> list[int]:
    """Offset ``o = h // ceil(H / r)`` of every head for one branch (so ``o < r``)."""
    group = math.ceil(num_heads / dilation_rate)
    return [h // group for h in range(num_heads)]


def branch_selection(seq_len: int, segment_length: int, dilation_rate: int,
                     num_heads: int) -> torch.Tensor:
    """Boolean ``(H, seq)``: position p is selected for head h in this branch.

    The segment length is ``min(w, seq)``; p is selected iff ``(p mod w) mod r == o_h``.
    """
    w = min(segment_length, seq_len)
    within = torch.arange(seq_len) % w
    offsets = torch.tensor(head_offsets(num_heads, dilation_rate))
    return (within[None, :] % dilation_rate) == offsets[:, None]  # (H, T)


def branch_counts(seq_len: int, segment_lengths: Sequence[int],
                  dilation_rates: Sequence[int], num_heads: int,
                  is_causal: bool = False) -> torch.Tensor:
    """``C[h, p, p']``: number of branches where p and p' are both selected, in one segment."""
    counts = torch.zeros(num_heads, seq_len, seq_len, dtype=torch.int64)
    positions = torch.arange(seq_len)
    for w, r in zip(segment_lengths, dilation_rates):
        segment = positions // min(w, seq_len)
        same_segment = segment[:, None] == segment[None, :]  # (T, T)
        selected = branch_selection(seq_len, w, r, num_heads)  # (H, T)
        pair = selected[:, :, None] & selected[:, None, :] & same_segment[None]
        counts += pair.long()
    if is_causal:
        counts = counts * torch.tril(torch.ones(seq_len, seq_len, dtype=torch.int64))
    return counts  # (H, T, T)


def dense_keep_mask(seed: torch.Tensor, batch: int, num_heads: int, seq_len: int,
                    p: float) -> torch.Tensor:
    """``(B, H, T, T)`` bool: the pairs that ``DilatedAttention``'s dropout keeps with ``seed``
    (``attention/pair_dropout.py``), for every pair at once."""
    positions = torch.arange(seq_len, device=seed.device)
    rows = row_words(seed, torch.arange(batch, device=seed.device).view(-1, 1, 1),
                     torch.arange(num_heads, device=seed.device).view(1, -1, 1), positions)
    keys = key_words(positions).expand(batch * num_heads, -1)
    return keep_pairs(rows.reshape(-1, seq_len), keys, p).view(batch, num_heads, seq_len, seq_len)


def dense_dilated_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            segment_lengths: Sequence[int], dilation_rates: Sequence[int],
                            softmax_scale: float | None = None, is_causal: bool = False,
                            key_padding_mask: torch.Tensor | None = None,
                            dropout_keep: torch.Tensor | None = None,
                            dropout: float = 0.0) -> torch.Tensor:
    """Reference dilated attention on ``(B, T, H, D)`` inputs; rows with ``C == 0`` give zero.

    ``key_padding_mask`` is ``(B, T)`` bool, True for keys to ignore (their C becomes 0).
    ``dropout_keep``: ``(B, H, T, T)`` bool; the merged probabilities of the pairs it keeps are
    scaled by ``1 / (1 - dropout)``, the others dropped (dropout on the softmax).
    """
    batch, seq_len, num_heads, head_dim = query.shape
    scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
    counts = branch_counts(seq_len, segment_lengths, dilation_rates, num_heads, is_causal)
    counts = counts.to(query.device)[None].expand(batch, -1, -1, -1)  # (B, H, T, T)
    if key_padding_mask is not None:
        counts = counts * (~key_padding_mask.to(query.device))[:, None, None, :].long()
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, H, T, D)
    scores = scale * (q @ k.transpose(-1, -2)) + torch.log(counts.to(q.dtype))  # (B, H, T, T)
    covered = counts.sum(-1, keepdim=True) > 0  # (B, H, T, 1)
    scores = torch.where(covered, scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, dim=-1) * covered
    if dropout_keep is not None:
        probs = probs * dropout_keep.to(query.device) / (1.0 - dropout)
    return (probs @ v).transpose(1, 2)  # (B, T, H, D)
