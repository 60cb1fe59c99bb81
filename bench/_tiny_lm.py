"""The seeded tiny LM that the optimizer benchmarks train, shared by bench scripts."""
from __future__ import annotations

import copy
import threading

import torch
from torch import nn

from attention.model import DilatedTransformerConfig, DilatedTransformerLM

_TEMPLATES: dict[int, nn.Module] = {}
_LOCK = threading.Lock()


def tiny_lm(seq_len: int) -> nn.Module:
    """A copy of the tiny LM seeded with 0. In-memory ranks are threads sharing torch's global
    generator, so the model is built once (under a lock) and every rank gets a copy; concurrent
    seeded initialisations would interleave."""
    with _LOCK:
        if seq_len not in _TEMPLATES:
            torch.manual_seed(0)
            _TEMPLATES[seq_len] = DilatedTransformerLM(DilatedTransformerConfig.preset(
                "tiny", seq_len=seq_len, segment_lengths=(8, 16, seq_len)))
        return copy.deepcopy(_TEMPLATES[seq_len])
