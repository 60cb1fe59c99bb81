"""``BlockSparseDilatedAttention``: attention restricted to a boolean block layout.

The sequence is cut into blocks of ``block_size``; query block i attends to key block j iff the
layout says so. Patterns (union of those given): a local window, dilated blocks inside segments
(``segment_blocks``, every ``dilation``-th block; ``dilation`` needs ``segment_blocks``),
global blocks, and a user-given ``(num_blocks, num_blocks)`` or ``(H, nb, nb)`` bool layout.
Only active blocks are computed: each query block gathers its active key blocks (padded to the
busiest row's count), so cost is O(seq * max active blocks per row * block_size).
Rows are normalised over their active keys only; a row with no active key gives zero.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

from attention.dilated import validate_inputs, validate_is_causal, validate_softmax_scale


def local_window_layout(num_blocks: int, window: int) -> torch.Tensor:
    """Blocks within ``window`` blocks of the diagonal."""
    idx = torch.arange(num_blocks)
    return (idx[:, None] - idx[None, :]).abs() <= window


def dilated_block_layout(num_blocks: int, segment_blocks: int, dilation: int) -> torch.Tensor:
    """Blocks of one segment of ``segment_blocks`` whose distance is a multiple of ``dilation``."""
    idx = torch.arange(num_blocks)
    same_segment = (idx[:, None] // segment_blocks) == (idx[None, :] // segment_blocks)
    return same_segment & (((idx[:, None] - idx[None, :]) % dilation) == 0)


def global_layout(num_blocks: int, global_blocks: int) -> torch.Tensor:
    """The first ``global_blocks`` blocks attend to and are attended by every block."""
    idx = torch.arange(num_blocks)
    return (idx[:, None] < global_blocks) | (idx[None, :] < global_blocks)


def _block_count(name: str, value, *, minimum: int, optional: bool = False) -> int | None:
    """``value`` as an ``int`` if it is an integer of at least ``minimum`` (None stays None where
    ``optional``).
    Floats were taken as they came: ``dilation=1.5`` silently kept blocks three apart,
    ``global_blocks=0.5`` made one block global, ``block_size=4.0`` failed inside torch."""
    if value is None and optional:
        return None
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < minimum:
        kind = "a positive" if minimum == 1 else "a non-negative"
        raise ValueError(f"{name} must be {kind} integer (a number of blocks), got {value!r}")
    return number


class BlockSparseDilatedAttention(nn.Module):
    """Attention over ``(B, T, H, D)`` restricted to an active-block layout, on one device.

    Its backward is torch's ``scaled_dot_product_attention``'s, which on CPU is not itself
    differentiable: a backward with ``create_graph=True`` (a gradient penalty) raises torch's
    "derivative for ..._backward is not implemented". ``DilatedAttention`` supports it."""

    def __init__(self, block_size: int, *, local_window: int | None = None,
                 segment_blocks: int | None = None, dilation: int = 1, global_blocks: int = 0,
                 block_layout: torch.Tensor | None = None,
                 softmax_scale: float | None = None) -> None:
        super().__init__()
        block_size = _block_count("block_size", block_size, minimum=1)
        local_window = _block_count("local_window", local_window, minimum=0, optional=True)
        segment_blocks = _block_count("segment_blocks", segment_blocks, minimum=1,
                                      optional=True)
        dilation = _block_count("dilation", dilation, minimum=1)
        global_blocks = _block_count("global_blocks", global_blocks, minimum=0)
        if dilation != 1 and segment_blocks is None:  # it was dropped without a word
            raise ValueError(f"dilation={dilation} applies to the dilated-segment pattern: give "
                             "segment_blocks too, or leave dilation at 1")
        if block_layout is not None and (not isinstance(block_layout, torch.Tensor)
                                         or block_layout.dtype != torch.bool
                                         or block_layout.dim() not in (2, 3)):
            what = (f"a {block_layout.dtype} tensor of shape {tuple(block_layout.shape)}"
                    if isinstance(block_layout, torch.Tensor) else f"a {type(block_layout).__name__}")
            raise ValueError(f"block_layout must be a bool (nb, nb) or (heads, nb, nb) tensor, got "
                             f"{what}; e.g. torch.tensor(rows, dtype=torch.bool)")
        if (local_window is None and segment_blocks is None and global_blocks == 0
                and block_layout is None):
            raise ValueError("give at least one pattern: local_window, segment_blocks, "
                             "global_blocks or block_layout")
        self.block_size, self.local_window = block_size, local_window
        self.segment_blocks, self.dilation = segment_blocks, dilation
        self.global_blocks, self.block_layout = global_blocks, block_layout
        self.softmax_scale = validate_softmax_scale(softmax_scale)

    def layout(self, num_blocks: int, num_heads: int, is_causal: bool = False) -> torch.Tensor:
        """``(H, nb, nb)`` bool: the union of the configured patterns (lower triangle if causal)."""
        active = torch.zeros(num_blocks, num_blocks, dtype=torch.bool)
        if self.local_window is not None:
            active |= local_window_layout(num_blocks, self.local_window)
        if self.segment_blocks is not None:
            active |= dilated_block_layout(num_blocks, self.segment_blocks, self.dilation)
        if self.global_blocks:
            active |= global_layout(num_blocks, self.global_blocks)
        active = active.expand(num_heads, -1, -1)
        if self.block_layout is not None:
            user = self.block_layout.cpu()
            if user.shape[-2:] != (num_blocks, num_blocks) or user.dim() == 3 and \
                    user.shape[0] != num_heads:
                raise ValueError(f"block_layout shape {tuple(user.shape)} does not fit "
                                 f"{num_heads} heads x {num_blocks} blocks")
            active = active | user
        if is_causal:
            active = active & torch.ones(num_blocks, num_blocks, dtype=torch.bool).tril()
        return active.contiguous()

    def _check_whole_blocks(self, seq_len: int) -> None:
        if seq_len % self.block_size != 0:
            raise ValueError(f"seq length {seq_len} must be a multiple of block_size "
                             f"{self.block_size}: pad the sequence (masking the padding with "
                             "key_padding_mask) or choose a block_size that divides it")

    def element_mask(self, seq_len: int, num_heads: int, is_causal: bool = False) -> torch.Tensor:
        """``(H, T, T)`` bool allowed-pairs mask equivalent to the layout (for checks); T must be
        a multiple of ``block_size``, as in ``forward``."""
        self._check_whole_blocks(seq_len)
        nb = seq_len // self.block_size
        mask = self.layout(nb, num_heads, is_causal)
        mask = mask.repeat_interleave(self.block_size, 1).repeat_interleave(self.block_size, 2)
        if is_causal:
            mask = mask & torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        return mask

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                is_causal: bool = False,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, T, H, D)`` -> ``(B, T, H, D)``; T must be a multiple of ``block_size``."""
        validate_is_causal(is_causal)
        validate_inputs(query, key, value, key_padding_mask)
        batch, seq_len, heads, head_dim = query.shape
        self._check_whole_blocks(seq_len)
        bs, nb = self.block_size, seq_len // self.block_size
        index, valid = _active_index(self.layout(nb, heads, is_causal), query.device)
        kmax = index.shape[-1]
        head_idx = torch.arange(heads, device=query.device).view(-1, 1)
        qb = query.view(batch, nb, bs, heads, head_dim).permute(0, 1, 3, 2, 4)  # (B, nb, H, bs, D)
        kb, vb = (_gather_blocks(t, index, head_idx, bs) for t in (key, value))  # (B,nb,H,K*bs,D)
        allowed = _allowed(valid, index, is_causal, bs, key_padding_mask, batch)  # (B,nb,H,bs,K*bs)
        has_key = allowed.any(-1, keepdim=True)
        # A row with no key attends everywhere and is zeroed after: no NaN, no gradient.
        allowed = allowed | ~has_key
        out = F.scaled_dot_product_attention(
            qb.reshape(batch * nb, heads, bs, head_dim),
            kb.reshape(batch * nb, heads, kmax * bs, head_dim),
            vb.reshape(batch * nb, heads, kmax * bs, head_dim),
            attn_mask=allowed.reshape(batch * nb, heads, bs, kmax * bs),
            scale=self.softmax_scale)
        out = out.view(batch, nb, heads, bs, head_dim) * has_key
        return out.permute(0, 1, 3, 2, 4).reshape(batch, seq_len, heads, head_dim)


def _active_index(layout: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(H, nb, K)`` active key-block indices per query block (padded) and their validity."""
    counts = layout.sum(-1)
    kmax = max(int(counts.max()), 1) if counts.numel() else 1  # no blocks: an empty sequence
    order = torch.argsort((~layout).to(torch.int8), dim=-1, stable=True)[..., :kmax]
    valid = torch.arange(kmax).view(1, 1, -1) < counts.unsqueeze(-1)
    return order.contiguous().to(device), valid.to(device)


def _gather_blocks(x, index, head_idx, bs):
    batch, seq_len, heads, head_dim = x.shape
    nb, kmax = index.shape[1], index.shape[2]
    blocks = x.view(batch, nb, bs, heads, head_dim).permute(0, 3, 1, 2, 4)  # (B, H, nb, bs, D)
    picked = blocks[:, head_idx, index.view(heads, -1)]  # (B, H, nb*K, bs, D)
    # reshape: a view for inputs laid out (B, T, H, D); a copy for others, e.g. batch-second
    picked = picked.reshape(batch, heads, nb, kmax * bs, head_dim)
    return picked.permute(0, 2, 1, 3, 4)  # (B, nb, H, K*bs, D)


def _allowed(valid, index, is_causal, bs, key_padding_mask, batch):
    heads, nb, kmax = index.shape
    allowed = valid.view(1, heads, nb, 1, kmax, 1).expand(batch, -1, -1, bs, -1, bs)
    if is_causal:
        q_pos = torch.arange(nb, device=index.device).view(1, nb, 1, 1, 1) * bs + \
            torch.arange(bs, device=index.device).view(1, 1, bs, 1, 1)
        k_pos = index.view(heads, nb, 1, kmax, 1) * bs + \
            torch.arange(bs, device=index.device).view(1, 1, 1, 1, bs)
        allowed = allowed & (k_pos <= q_pos).unsqueeze(0)
    if key_padding_mask is not None:
        keep = ~key_padding_mask.view(batch, nb, bs)[:, index]  # (B, H, nb, K, bs)
        allowed = allowed & keep.unsqueeze(3)
    return allowed.reshape(batch, heads, nb, bs, kmax * bs).permute(0, 2, 1, 3, 4)
