"""Positions of a slice of a sequence (context parallelism). A leaf module: it imports only
torch, so ``distframe`` can use it while ``attention`` is still being imported."""
from __future__ import annotations

import torch


def shard_positions(tokens: torch.Tensor, sequence_shard: tuple[int, int], seq_len: int) -> torch.Tensor:
    """Positions of ``tokens (B, T)``, slice ``index`` of ``count`` equal slices of a sequence
    (``sequence_shard = (index, count)``): ``index * T ... index * T + T - 1``."""
    index, count = sequence_shard
    length = tokens.shape[1]
    if length * count > seq_len:
        whole = f"{count} slices of {length} tokens" if count > 1 else f"sequence of {length} tokens"
        raise ValueError(f"a {whole} exceeds config.seq_len {seq_len}")
    return torch.arange(index * length, (index + 1) * length, device=tokens.device)
