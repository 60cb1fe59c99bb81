"""Exact LongNet dilated attention: single device, multi-head, ring (sequence parallel),
block-sparse, and the decoder-only language model built on it.

[Note: dilated attention under torch.compile] The attention's internals (slot plans cached on
the module, a custom autograd Function with its own backward, the kernels, the ring and
block-sparse forms, the activation-checkpointing contexts) are on TorchDynamo's skip list
(``dynamo_skip``). Traced by Dynamo, that code went wrong on Python 3.12 (where
``functools.cached_property`` has no lock, so Dynamo traced the plans' cached layouts): with torch
2.11 a compiled LM's loss left the uncompiled one's two steps after its first evaluation pass (by
0.03, float64, CPU and GPU), and with torch 2.13 Dynamo failed inside its tracing of the autograd
Function. On Python 3.11 the lock broke the graph at each plan and the results were exact, but each
plan recompiled the small functions it calls until Dynamo's recompile limit. ``DilatedAttention``'s
own forward (``dilated.py``: argument checks) is traced, and where it can it calls the attention as
one operator ([Note: dilated attention as an operator] in ``compiled_op.py``), so a compiled block
is one graph; elsewhere the graph breaks at the attention call, which runs as it runs uncompiled.
"""
from attention import dynamo_skip as _dynamo_skip

_dynamo_skip.skip(*(f"attention.{name}" for name in (
    "uncompiled", "function", "plan", "kernel", "pair_dropout", "autograd_path", "ring",
    "ring_exchange", "block_sparse", "recompute")))

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
