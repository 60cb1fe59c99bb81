"""Exact LongNet dilated attention: single device, multi-head, ring (sequence parallel),
block-sparse, and the decoder-only language model built on it.

[Note: dilated attention under torch.compile] The attention modules' forward (``DilatedAttention``,
its ring and block-sparse forms) and the code under it (slot plans cached on the module, a custom
autograd Function with its own backward, the kernels) are on TorchDynamo's skip list
(``dynamo_skip``): a compiled block or LM breaks its graph at the attention call and runs the
attention as it runs uncompiled. Traced by Dynamo, that code went wrong on Python 3.12 (where
``functools.cached_property`` has no lock, so Dynamo traced the plans' cached layouts): with torch
2.11 a compiled LM's loss left the uncompiled one's two steps after its first evaluation pass (by
0.03, float64, CPU and GPU), and with torch 2.13 Dynamo failed inside its tracing of the autograd
Function. On Python 3.11 the lock broke the graph at each plan and the results were exact, but each
plan recompiled the small functions it calls until Dynamo's recompile limit.
"""
from attention import dynamo_skip as _dynamo_skip

_dynamo_skip.skip(*(f"attention.{name}" for name in (
    "dilated", "function", "plan", "kernel", "pair_dropout", "autograd_path", "ring",
    "ring_exchange", "block_sparse")))

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
