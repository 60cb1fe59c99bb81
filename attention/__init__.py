"""Exact LongNet dilated attention: single device, multi-head, ring (sequence parallel),
block-sparse, and the decoder-only language model built on it."""
from attention.block_sparse import BlockSparseDilatedAttention
from attention.dilated import DilatedAttention
from attention.model import DilatedTransformerConfig, DilatedTransformerLM
from attention.multihead import MultiheadDilatedAttention
from attention.reference import dense_dilated_attention
from attention.ring import RingDilatedAttention

__all__ = [
    "BlockSparseDilatedAttention",
    "DilatedAttention",
    "DilatedTransformerConfig",
    "DilatedTransformerLM",
    "MultiheadDilatedAttention",
    "RingDilatedAttention",
    "dense_dilated_attention",
]
