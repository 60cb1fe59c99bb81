"""Dilated attention as one operator that torch.compile keeps whole.

[Note: dilated attention as an operator] A compiled block reaches ``DilatedAttention.forward``
(which Dynamo traces: validation only) and, where the module reads its keys locally and draws no
attention dropout, calls ``torch.ops.distframe.dilated_attention`` instead of the code in
``attention/uncompiled.py``. Dynamo records the operator as one node of the block's graph, as it
would a built-in attention: a fake rule gives its outputs' shapes, and its backward is a second
operator, ``distframe::dilated_attention_backward``. So the projections, norms and MLP around it
compile into one graph with no break, and the attention runs what it runs uncompiled
(``forward_units`` and ``backward_units`` in ``attention/function.py``: the same units and
kernels, the same numbers). Where the operator cannot stand in (attention dropout in training:
its masks come from a generator the operator would not see; the ring, whose keys come from other
ranks), the graph breaks at the attention call, as it did for every call before.

The operators' key sources are cached here per layout (not on the module: an operator sees
tensors and numbers only), the most recent ``KeySourceCache`` entries, under a lock since ranks
of the in-memory engine are threads. ``torch.library.custom_op`` is torch 2.4's; with an older
torch ``AVAILABLE`` is False and every call takes the break. The backward operator is not itself
differentiable (AOTAutograd has no double backward for compiled graphs either); uncompiled,
``backward(create_graph=True)`` still works ([Note: double backward] in attention/function.py).
"""
from __future__ import annotations

import threading

import torch

from attention.function import backward_units, forward_units
from attention.kernel import accumulate_dtype
from attention.uncompiled import KeySourceCache, local_key_sources

AVAILABLE = hasattr(torch.library, "custom_op")

_sources = KeySourceCache(16)
_sources_lock = threading.Lock()


def _key_sources(query: torch.Tensor, segment_lengths: list[int], dilation_rates: list[int],
                 is_causal: bool, head_start: int, total_heads: int):
    _, seq_len, num_heads, _ = query.shape
    with _sources_lock:
        return local_key_sources(_sources, seq_len, num_heads, query.device, is_causal,
                                 segment_lengths, dilation_rates, head_start, total_heads)


def dilated_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      key_padding_mask: torch.Tensor | None, segment_lengths, dilation_rates,
                      is_causal: bool, scale: float, head_start: int, total_heads: int
                      ) -> torch.Tensor:
    """``(B, T, H, D)`` -> ``(B, T, H, D)``: heads ``[head_start, head_start + H)`` of
    ``total_heads``, as ``DilatedAttention`` computes them without dropout."""
    out, _ = torch.ops.distframe.dilated_attention(
        query, key, value, key_padding_mask, list(segment_lengths), list(dilation_rates),
        is_causal, scale, head_start, total_heads)
    return out


if AVAILABLE:
    @torch.library.custom_op("distframe::dilated_attention", mutates_args=())
    def _forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_padding_mask: torch.Tensor | None, segment_lengths: list[int],
                 dilation_rates: list[int], is_causal: bool, scale: float, head_start: int,
                 total_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        sources = _key_sources(query, segment_lengths, dilation_rates, is_causal, head_start,
                               total_heads)
        return forward_units(query, key, value, key_padding_mask, sources, is_causal, scale)

    @_forward.register_fake
    def _(query, key, value, key_padding_mask, segment_lengths, dilation_rates, is_causal, scale,
          head_start, total_heads):
        return (query.new_empty(query.shape),
                query.new_empty(query.shape[:3], dtype=accumulate_dtype(query.dtype)))

    @torch.library.custom_op("distframe::dilated_attention_backward", mutates_args=())
    def _backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, key_padding_mask: torch.Tensor | None, out: torch.Tensor,
                  lse: torch.Tensor, segment_lengths: list[int], dilation_rates: list[int],
                  is_causal: bool, scale: float, head_start: int, total_heads: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sources = _key_sources(query, segment_lengths, dilation_rates, is_causal, head_start,
                               total_heads)
        return backward_units(grad_out, query, key, value, key_padding_mask, out, lse, sources,
                              is_causal, scale)

    @_backward.register_fake
    def _(grad_out, query, key, value, key_padding_mask, out, lse, segment_lengths,
          dilation_rates, is_causal, scale, head_start, total_heads):
        return tuple(t.new_empty(t.shape) for t in (query, key, value))

    def _setup_context(ctx, inputs, output) -> None:
        query, key, value, key_padding_mask, *config = inputs
        out, lse = output
        ctx.save_for_backward(query, key, value, key_padding_mask, out, lse)
        ctx.config = config
        ctx.mark_non_differentiable(lse)

    def _differentiate(ctx, grad_out, _grad_lse):
        query, key, value, key_padding_mask, out, lse = ctx.saved_tensors
        grads = torch.ops.distframe.dilated_attention_backward(
            grad_out, query, key, value, key_padding_mask, out, lse, *ctx.config)
        return (*grads, *(None for _ in range(len(ctx.config) + 1)))

    _forward.register_autograd(_differentiate, setup_context=_setup_context)
