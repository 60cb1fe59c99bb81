"""Exact LongNet dilated attention: single device, multi-head, ring (sequence parallel),
block-sparse, and the decoder-only language model built on it."""
from attention.dilated import DilatedAttention

__all__ = ["DilatedAttention"]
