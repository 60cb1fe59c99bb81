"""``MultiheadDilatedAttention``: projections + dilated attention + MAGNETO sub-layer norm.

Batch-first ``(batch, seq, embed_dim)``. ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` are
separate ``nn.Linear`` submodules so a tensor-parallel plan can split the first three by columns
and ``out_proj`` by rows (``num_heads`` is then the local head count).
"""
from __future__ import annotations

import math
import numbers
from typing import Sequence

import torch
from torch import nn

from attention.dilated import (DilatedAttention, key_padding_mask_as_bool, positive_int,
                              validate_dropout)


class MultiheadDilatedAttention(nn.Module):
    """LongNet multi-head dilated attention.

    Output is ``out_proj(layer_norm(attention))``: the MAGNETO sub-LN sits before the output
    projection (``layer_norm=False`` removes it). Initialisation follows LongNet/MAGNETO:
    Xavier-normal for ``q_proj``/``k_proj``, Xavier-normal with gain ``gamma_init`` for
    ``v_proj``/``out_proj``, zero biases. With one branch covering the sequence, dilation 1 and
    ``layer_norm=False`` it computes what ``nn.MultiheadAttention(batch_first=True)`` computes
    with the same weights. It takes that module's keywords where dilated attention can honour
    them (``batch_first=True``; ``attn_mask`` None or the causal mask, ``need_weights=False``,
    ``average_attn_weights``; ``key_padding_mask`` bool or the float 0/-inf form torch passes on)
    and refuses the others saying what to pass (``torch_mha_keywords``), so it can stand in as
    ``self_attn`` of ``nn.TransformerEncoderLayer``.
    """

    # Read by nn.TransformerEncoder(Layer) to choose its fused fast path, which needs
    # nn.MultiheadAttention's packed in_proj_weight: there is none here, so they stay off it.
    _qkv_same_embed_dim = False
    in_proj_bias = None

    def __init__(self, embed_dim: int, num_heads: int, *, segment_lengths: Sequence[int],
                 dilation_rates: Sequence[int], dropout: float = 0.0, bias: bool = True,
                 layer_norm: bool = True, layer_norm_eps: float = 1e-5, gamma_init: float = 1.0,
                 batch_first: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if batch_first is not True:  # (seq, batch, embed) would be attended along the batch
            raise ValueError(f"MultiheadDilatedAttention takes (batch, seq, embed_dim) inputs only, "
                             f"got batch_first={batch_first!r}; pass (seq, batch, embed_dim) inputs "
                             "as x.transpose(0, 1)")
        self.batch_first = True
        embed_dim, num_heads = positive_int("embed_dim", embed_dim), positive_int("num_heads", num_heads)
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads "
                             f"({num_heads})")
        if (isinstance(layer_norm_eps, bool) or not isinstance(layer_norm_eps, numbers.Real)
                or not 0 < layer_norm_eps < math.inf):  # -1e-5 or NaN gave NaN outputs
            raise ValueError(f"layer_norm_eps must be a positive finite number (e.g. 1e-5), got "
                             f"{layer_norm_eps!r}")
        if (isinstance(gamma_init, bool) or not isinstance(gamma_init, numbers.Real)
                or not 0 <= gamma_init < math.inf):  # else torch's "normal expects std >= 0.0"
            raise ValueError(f"gamma_init must be a finite number >= 0 (the Xavier gain of v_proj "
                             f"and out_proj, e.g. 1.0), got {gamma_init!r}")
        head_dim = embed_dim // num_heads
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.gamma_init = gamma_init
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.attention = DilatedAttention(segment_lengths, dilation_rates,
                                          attention_dropout=validate_dropout("dropout", dropout))
        self.norm = (nn.LayerNorm(embed_dim, eps=layer_norm_eps, **factory)
                     if layer_norm else None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_normal_(self.q_proj.weight)
        nn.init.xavier_normal_(self.k_proj.weight)
        nn.init.xavier_normal_(self.v_proj.weight, gain=self.gamma_init)
        nn.init.xavier_normal_(self.out_proj.weight, gain=self.gamma_init)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        if self.norm is not None:
            self.norm.reset_parameters()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                is_causal: bool = False, key_padding_mask: torch.Tensor | None = None, *,
                need_weights: bool = False, attn_mask: torch.Tensor | None = None,
                average_attn_weights: bool = True) -> tuple[torch.Tensor, None]:
        """``(B, T, E)`` inputs -> ``((B, T, E), None)`` (no attention weights are formed)."""
        if query.dim() != 3:
            raise ValueError(f"query must be (batch, seq, embed_dim), got {tuple(query.shape)}")
        if torch_mha_keywords(need_weights, attn_mask, query.shape[1]):
            is_causal = True
        if key.shape != query.shape or value.shape != query.shape:
            raise ValueError(f"dilated attention segments one sequence: key and value must have "
                             f"the query's shape {tuple(query.shape)}, got key "
                             f"{tuple(key.shape)} and value {tuple(value.shape)}")
        if query.shape[-1] != self.q_proj.in_features:  # else a matmul error naming neither
            raise ValueError(f"query, key and value must be (batch, seq, embed_dim="
                             f"{self.q_proj.in_features}), got last dimension {query.shape[-1]}")
        batch, seq_len, _ = query.shape
        # num_heads follows the projection width, so a column-split q_proj just works.
        heads = self.q_proj.out_features // self.head_dim
        q = self.q_proj(query).view(batch, seq_len, heads, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(key).view(batch, seq_len, heads, self.head_dim)
        v = self.v_proj(value).view(batch, seq_len, heads, self.head_dim)
        padding = key_padding_mask_as_bool(key_padding_mask)  # (B, T) bool, or None
        attended = self.attention(q, k, v, is_causal=is_causal, key_padding_mask=padding)  # (B, T, H, D)
        attended = attended.reshape(batch, seq_len, heads * self.head_dim)  # (B, T, E)
        if self.norm is not None:
            attended = self.norm(attended)
        return self.out_proj(attended), None


def torch_mha_keywords(need_weights: bool, attn_mask: torch.Tensor | None, seq_len: int) -> bool:
    """nn.MultiheadAttention's ``need_weights`` and ``attn_mask``: ValueError unless they ask for
    what dilated attention does (no weights; no mask, or the causal one); ``average_attn_weights``
    only shapes weights, so it is ignored. True when ``attn_mask`` is the causal mask (as
    nn.TransformerEncoder passes it): what ``is_causal=True`` does. The mask is checked, not
    trusted on an ``is_causal`` hint as torch's fused path trusts it."""
    if need_weights:
        raise ValueError("dilated attention forms no attention weights (it never builds the T x T "
                         "matrix); pass need_weights=False (nn.MultiheadAttention's default is True)")
    if attn_mask is None:
        return False
    if not isinstance(attn_mask, torch.Tensor) or tuple(attn_mask.shape) != (seq_len, seq_len):
        shape = tuple(attn_mask.shape) if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__
        raise ValueError(f"attn_mask must be the causal (seq, seq) = ({seq_len}, {seq_len}) mask or None, "
                         f"got {shape}; pass is_causal=True instead of a mask")
    future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=attn_mask.device).triu(1)
    if attn_mask.dtype == torch.bool:
        causal = torch.equal(attn_mask, future)
    else:  # additive: -inf above the diagonal, 0 elsewhere
        causal = bool(((attn_mask == -math.inf) == future).all() and (attn_mask[~future] == 0).all())
    if not causal:
        raise ValueError("dilated attention takes no attn_mask but the causal one: its segments and "
                         "dilations decide what each position attends to; pass is_causal=True for a "
                         "causal mask and key_padding_mask=(batch, seq) for padding")
    return True
