"""``DilatedAttention``: LongNet's dilated attention, exact, on one device.

Every branch ``(w, r)`` uses all heads; head h reads positions ``(p mod w') mod r == o_h`` with
``o_h = h // ceil(H / r)`` inside segments of length ``w' = min(w, seq)``; branch outputs are
merged by ``exp(lse_i - logsumexp_j lse_j)``; positions no branch covers are zero. Equivalent to
``softmax(scale * Q K^T + log C) V`` (see ``attention/reference.py``).
"""
from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from typing import Sequence

import torch
from torch import nn

from attention import compiled_op
from attention.uncompiled import KeySourceCache, UncompiledDilatedAttention


def positive_int(name: str, value, *, entry: bool = False) -> int:
    """``value`` as an ``int`` if it is a positive integral number (not a bool, not a float);
    ``entry``: it is one entry of the argument ``name``."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number <= 0:
        what = "hold positive integers" if entry else "be a positive integer"
        raise ValueError(f"{name} must {what}, got {value!r}")
    return number


def validate_dropout(name: str, value) -> float:
    """A dropout probability: a real number in ``[0, 1)`` (not a bool), as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def validate_softmax_scale(softmax_scale) -> float | None:
    """None (``head_dim ** -0.5`` at run time) or a positive finite real number, as a float."""
    if softmax_scale is None:
        return None
    if (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)
            or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale must be a positive finite number (or None for "
                         f"head_dim ** -0.5), got {softmax_scale!r}")
    return float(softmax_scale)


def validate_branches(segment_lengths: Sequence[int], dilation_rates: Sequence[int]
                      ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Check the branch configuration; raise ``ValueError`` naming the bad argument. Any integral
    number is accepted (numpy integers from a config) and returned as a Python ``int``."""
    for name, values in (("segment_lengths", segment_lengths), ("dilation_rates", dilation_rates)):
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            # DilatedAttention(2048, 1) failed with "'int' object is not iterable"
            raise ValueError(f"{name} must be a sequence of positive integers, one per branch "
                             f"(e.g. [2048] for one branch), got {values!r}")
    segments = tuple(positive_int("segment_lengths", value, entry=True) for value in segment_lengths)
    rates = tuple(positive_int("dilation_rates", value, entry=True) for value in dilation_rates)
    if len(segments) == 0:
        raise ValueError("segment_lengths must name at least one branch")
    if len(segments) != len(rates):
        raise ValueError(f"segment_lengths ({len(segments)} entries) and dilation_rates "
                         f"({len(rates)} entries) must have the same length")
    for w, r in zip(segments, rates):
        if w % r != 0:
            raise ValueError(f"segment_lengths: segment {w} is not divisible by its "
                             f"dilation_rates entry {r}")
    return segments, rates


def validate_is_causal(is_causal) -> None:
    """``is_causal`` is a Python bool. A caller used to ``nn.MultiheadAttention`` may pass the
    key padding mask as the fourth positional argument, which here is ``is_causal``: a mask of one
    element was taken for True without a word, a longer one failed on an ambiguous truth value."""
    if not isinstance(is_causal, bool):
        what = (f"a tensor of shape {tuple(is_causal.shape)}" if isinstance(is_causal, torch.Tensor)
                else repr(is_causal))
        raise ValueError(f"is_causal must be True or False, got {what}; the argument after q, k, v "
                         "is is_causal: pass a padding mask as key_padding_mask=...")


def validate_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_padding_mask: torch.Tensor | None) -> None:
    """Shapes ``(B, T, H, D)``, equal for q, k, v, as are dtype (floating point) and device;
    mask ``(B, T)`` bool."""
    for name, given in (("query", query), ("key", key), ("value", value),
                        ("key_padding_mask", key_padding_mask)):
        if given is not None and not isinstance(given, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(given).__name__}: convert it "
                             "with torch.as_tensor(...)")
    if query.dim() != 4:
        raise ValueError(f"query must be (batch, seq, heads, head_dim), got {tuple(query.shape)}")
    if not query.is_floating_point():  # the output would be cast back to it: truncated
        raise ValueError(f"query dtype {query.dtype} is not a floating-point dtype: attention "
                         "needs float q, k and v (convert them, e.g. with .float())")
    for name, tensor in (("key", key), ("value", value)):
        for what in ("dtype", "device"):
            if getattr(tensor, what) != getattr(query, what):
                raise ValueError(f"{name} {what} {getattr(tensor, what)} differs from query "
                                 f"{what} {getattr(query, what)}: pass q, k and v alike")
        if tensor.shape[-1] != query.shape[-1]:
            raise ValueError(f"{name} head_dim {tensor.shape[-1]} differs from query head_dim "
                             f"{query.shape[-1]}")
        if tensor.shape != query.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} differs from query shape "
                             f"{tuple(query.shape)}")
    if key_padding_mask is not None:
        if key_padding_mask.shape != query.shape[:2]:
            raise ValueError(f"key_padding_mask must be (batch, seq) = {tuple(query.shape[:2])}, "
                             f"got {tuple(key_padding_mask.shape)}")
        if key_padding_mask.dtype != torch.bool:
            raise ValueError(f"key_padding_mask must be a bool tensor (True = ignore the key), got "
                             f"{key_padding_mask.dtype}")
        if key_padding_mask.device != query.device:
            raise ValueError(f"key_padding_mask device {key_padding_mask.device} differs from query "
                             f"device {query.device}: move the mask to the query's device")


def key_padding_mask_as_bool(key_padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """nn.MultiheadAttention's float form of ``key_padding_mask`` as the bool one (True = ignore
    the key); any other mask is returned as given. nn.TransformerEncoder(Layer) turns a user's bool
    ``src_key_padding_mask`` into an additive float mask, 0 to keep a key and -inf to ignore it,
    before it calls ``self_attn``. Other float values would bias the scores, which dilated
    attention cannot do: ValueError."""
    if not isinstance(key_padding_mask, torch.Tensor) or not key_padding_mask.is_floating_point():
        return key_padding_mask
    ignore = key_padding_mask == -math.inf
    if not bool((ignore | (key_padding_mask == 0)).all()):
        raise ValueError("a floating-point key_padding_mask must hold only 0 (attend) and -inf (ignore "
                         "the key), the form nn.TransformerEncoder passes; dilated attention adds no "
                         "other bias to the scores: pass a bool mask, True = ignore the key")
    return ignore


class DilatedAttention(UncompiledDilatedAttention, nn.Module):
    """Exact dilated attention on ``(batch, seq, heads, head_dim)`` tensors, one device.

    Cost per branch: O(seq * w / r) time and O(seq) memory; never a seq x seq matrix. Uses the
    fused flash kernel on CPU (fp32, fp64, fp16, bf16; merges accumulate in fp32). With
    ``attention_dropout > 0`` in training mode it takes a slower path differentiated by
    autograd, dropping merged attention probabilities: one decision per (batch, head, query,
    key) pair, from a hash seeded by ``dropout_generator`` (see ``attention/pair_dropout.py``).
    """

    #: Whether a compiled caller may run this forward as ``distframe::dilated_attention`` (keys
    #: read locally, as ``_key_sources`` reads them here); the ring's come from other ranks.
    _compiles_to_operator = True

    def __init__(self, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
                 softmax_scale: float | None = None, attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.segment_lengths, self.dilation_rates = validate_branches(segment_lengths,
                                                                      dilation_rates)
        self.softmax_scale = validate_softmax_scale(softmax_scale)
        self.attention_dropout = validate_dropout("attention_dropout", attention_dropout)
        self._sources = KeySourceCache()  # (seq, heads, device, causal, branches) -> key sources

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                is_causal: bool = False,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, T, H, D)`` q, k, v -> ``(B, T, H, D)``."""
        validate_is_causal(is_causal)
        validate_inputs(query, key, value, key_padding_mask)
        if query.numel() == 0:  # an empty batch or sequence: no segments, nothing to attend to
            return (query + key + value) * 0.0  # (B, T, H, D), in the graph of q, k and v
        batch, seq_len, num_heads, head_dim = query.shape
        scale = self.softmax_scale if self.softmax_scale is not None else head_dim ** -0.5
        if (torch.compiler.is_compiling() and compiled_op.AVAILABLE and self._compiles_to_operator
                and not (self.training and self.attention_dropout > 0.0)):
            # [Note: dilated attention as an operator]: one node of the compiled graph
            total = num_heads if self.total_heads is None else self.total_heads
            return compiled_op.dilated_attention(
                query, key, value, key_padding_mask, self.segment_lengths, self.dilation_rates,
                is_causal, scale, self.head_start, total)
        return self._forward_uncompiled(query, key, value, is_causal, key_padding_mask, scale)

    def extra_repr(self) -> str:
        return (f"segment_lengths={list(self.segment_lengths)}, "
                f"dilation_rates={list(self.dilation_rates)}, "
                f"attention_dropout={self.attention_dropout}")
