"""The frames of ``DilatedAttention`` that TorchDynamo must not trace: its cached key sources
(slot plans with lazily built index layouts) and its forward as it runs uncompiled (the autograd
Function, or the attention-dropout path). This module is on Dynamo's skip list
([Note: dilated attention under torch.compile] in attention/__init__.py); ``DilatedAttention``'s
own forward is not, so that a compiled caller reaches the operator in ``attention/compiled_op.py``.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from attention.autograd_path import dilated_attention_autograd
from attention.function import DilatedAttentionFunction, LocalKeySource
from attention.plan import make_slot_plans


class KeySourceCache(OrderedDict):
    """The key sources (index layouts) of the most recent ``max_entries`` shapes, least recently
    used dropped first: each holds O(seq * heads) index tensors, and a model run on many sequence
    lengths (generation, variable-length batches) would otherwise keep one set per length."""

    def __init__(self, max_entries: int = 8) -> None:
        super().__init__()
        self.max_entries = max_entries

    def __getitem__(self, key):
        self.move_to_end(key)
        return super().__getitem__(key)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.max_entries:
            self.popitem(last=False)


def local_key_sources(cache: KeySourceCache, seq_len: int, num_heads: int, device: torch.device,
                      is_causal: bool, segment_lengths, dilation_rates, head_start: int,
                      total_heads: int) -> list[LocalKeySource]:
    """The key sources of heads ``[head_start, head_start + num_heads)`` of ``total_heads``
    (all of them on one device; a rank's share under tensor parallelism), one per head group of
    each branch, from ``cache`` or built into it. Keyed by the branches too: a module whose
    segment_lengths or dilation_rates are changed after a forward must not keep the old ones."""
    cache_key = (seq_len, num_heads, str(device), is_causal, tuple(segment_lengths),
                 tuple(dilation_rates), head_start, total_heads)
    if cache_key not in cache:
        cache[cache_key] = [
            LocalKeySource(plan, is_causal)
            for w, r in zip(segment_lengths, dilation_rates)
            for plan in make_slot_plans(seq_len=seq_len, start=0, stop=seq_len, segment_length=w,
                                        dilation_rate=r, num_heads=total_heads,
                                        heads=(head_start, head_start + num_heads), device=device)]
    return cache[cache_key]


class UncompiledDilatedAttention:
    """What ``DilatedAttention`` runs outside torch.compile, and inside it where the operator
    cannot stand in (attention dropout in training, a subclass with keys of its own)."""

    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    attention_dropout: float
    training: bool
    #: Global index of the first head passed in, and how many heads the full module has (None:
    #: those passed in). A head-split (tensor-parallel) subclass sets them, so that its plans read
    #: what the full module's heads read and its pairs draw the dropout decisions they draw.
    head_start: int = 0
    total_heads: int | None = None
    _sources: KeySourceCache

    def _key_sources(self, seq_len: int, num_heads: int, device: torch.device,
                     is_causal: bool) -> list[LocalKeySource]:
        total = num_heads if self.total_heads is None else self.total_heads
        return local_key_sources(self._sources, seq_len, num_heads, device, is_causal,
                                 self.segment_lengths, self.dilation_rates, self.head_start, total)

    def dropout_generator(self, device: torch.device) -> torch.Generator | None:
        """Where the attention-dropout masks come from: torch's global generator (None) here;
        a subclass may name its own generator on ``device``."""
        return None

    def _forward_uncompiled(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            is_causal: bool, key_padding_mask: torch.Tensor | None,
                            scale: float) -> torch.Tensor:
        batch, seq_len, num_heads, head_dim = query.shape
        sources = self._key_sources(seq_len, num_heads, query.device, is_causal)
        if self.training and self.attention_dropout > 0.0:
            return dilated_attention_autograd(query, key, value, sources, is_causal=is_causal,
                                              key_padding_mask=key_padding_mask, scale=scale,
                                              dropout=self.attention_dropout,
                                              generator=self.dropout_generator(query.device),
                                              first_head=self.head_start)
        out, _ = DilatedAttentionFunction.apply(query, key, value, key_padding_mask, sources,
                                                is_causal, scale)
        return out
