"""``MultiheadDilatedAttention`` split by heads across a tensor-parallel group.

Rank r of t holds heads ``[r*H/t, (r+1)*H/t)``: the matching output columns of ``q_proj``,
``k_proj`` and ``v_proj`` (column-parallel behind one shared ``f``), the matching features of the
MAGNETO sub-layer norm (a ShardedLayerNorm) and the matching input columns of ``out_proj``
(row-parallel, ``g``). Dilated attention reads, for head h, positions with offset
``h // ceil(H / r)`` of the *global* head index, so the local kernel is given plans built for
all H heads and then narrowed to this rank's heads: the result is the dense module's, exactly.

Collectives per forward: one all-reduce of ``(B, T, E)`` (out_proj) plus, with the sub-LN, two
of ``(B, T, 1)``; backward the same (the ``f`` of q/k/v and the statistics).
"""
from __future__ import annotations

import torch
from torch import nn

from attention.dilated import DilatedAttention, key_padding_mask_as_bool
from attention.multihead import MultiheadDilatedAttention, torch_mha_keywords
from distframe.backends.functional import copy_to_parallel_region
from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError
from distframe.models.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                              ShardedLayerNorm, shard_range)
from distframe.models.tensor_parallel_rng import TensorParallelRNG


class HeadShardedDilatedAttention(DilatedAttention):
    """Dilated attention over heads ``[head_start, head_start + local_heads)`` of ``total_heads``.

    Its attention-dropout masks (this rank's heads only) come from ``rng.split_generator``, drawn
    independently on each tensor rank, or from torch's global generator when ``rng`` is None.
    """

    def __init__(self, dense: DilatedAttention, *, head_start: int, total_heads: int,
                 rng: TensorParallelRNG | None = None) -> None:
        super().__init__(dense.segment_lengths, dense.dilation_rates,
                         softmax_scale=dense.softmax_scale, attention_dropout=dense.attention_dropout)
        self.head_start, self.total_heads = head_start, total_heads
        self.rng = rng

    def dropout_generator(self, device: torch.device) -> torch.Generator | None:
        return None if self.rng is None else self.rng.split_generator(device)


class TensorParallelDilatedAttention(nn.Module):
    """Drop-in for a ``MultiheadDilatedAttention`` (same forward signature), split by heads;
    ``rng``: where the attention dropout draws (see HeadShardedDilatedAttention)."""

    # As MultiheadDilatedAttention's: keeps nn.TransformerEncoder(Layer) off its fused fast path.
    _qkv_same_embed_dim = False
    in_proj_bias = None

    def __init__(self, dense: MultiheadDilatedAttention, backend: ICommunicationBackend,
                 shared: dict | None = None, rng: TensorParallelRNG | None = None) -> None:
        super().__init__()
        if dense.num_heads % backend.world_size:
            raise ConfigError(f"num_heads ({dense.num_heads}) is not divisible by the tensor-parallel "
                              f"degree {backend.world_size}; choose tp dividing the head count")
        self.backend = backend
        self.head_dim = dense.head_dim
        self.local_heads = dense.num_heads // backend.world_size
        lo, _ = shard_range(dense.num_heads, backend, "num_heads")
        make = ColumnParallelLinear.from_dense
        self.q_proj = make(dense.q_proj, backend, copy_input=False, shared=shared)
        self.k_proj = make(dense.k_proj, backend, copy_input=False, shared=shared)
        self.v_proj = make(dense.v_proj, backend, copy_input=False, shared=shared)
        self.attention = HeadShardedDilatedAttention(dense.attention, head_start=lo,
                                                     total_heads=dense.num_heads, rng=rng)
        self.attention.train(dense.training)
        self.norm = None if dense.norm is None else ShardedLayerNorm.from_dense(dense.norm, backend)
        self.out_proj = RowParallelLinear.from_dense(dense.out_proj, backend, shared=shared)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                is_causal: bool = False, key_padding_mask: torch.Tensor | None = None, *,
                need_weights: bool = False, attn_mask: torch.Tensor | None = None,
                average_attn_weights: bool = True) -> tuple[torch.Tensor, None]:
        if query.dim() != 3:
            raise ValueError(f"query must be (batch, seq, embed_dim), got {tuple(query.shape)}")
        if torch_mha_keywords(need_weights, attn_mask, query.shape[1]):
            is_causal = True  # the causal mask, as the dense module takes it
        batch, seq_len, _ = query.shape
        # One f for self-attention (q, k, v read the same tensor): one backward all-reduce.
        query_p = copy_to_parallel_region(query, self.backend)
        key_p = query_p if key is query else copy_to_parallel_region(key, self.backend)
        value_p = (query_p if value is query else key_p if value is key
                   else copy_to_parallel_region(value, self.backend))
        shape = (batch, seq_len, self.local_heads, self.head_dim)
        q = self.q_proj(query_p).view(shape)  # (B, T, H/t, D)
        k = self.k_proj(key_p).view(batch, key.shape[1], self.local_heads, self.head_dim)
        v = self.v_proj(value_p).view(batch, value.shape[1], self.local_heads, self.head_dim)
        padding = key_padding_mask_as_bool(key_padding_mask)  # the float 0/-inf form as bool
        attended = self.attention(q, k, v, is_causal=is_causal, key_padding_mask=padding)
        attended = attended.reshape(batch, seq_len, self.local_heads * self.head_dim)  # (B, T, E/t)
        if self.norm is not None:
            attended = self.norm(attended)
        return self.out_proj(attended), None
