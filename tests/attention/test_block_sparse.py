"""BlockSparseDilatedAttention equals dense attention under the equivalent element mask."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attention import BlockSparseDilatedAttention, DilatedAttention
from attention_helpers import max_error, outputs_and_grads, random_qkv


def _dense(q, k, v, allowed):  # allowed (B, H, T, T)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    scores = (qh @ kh.transpose(-1, -2)) * q.shape[-1] ** -0.5
    has_key = allowed.any(-1, keepdim=True)
    scores = torch.where(has_key, scores.masked_fill(~allowed, float("-inf")), 0.0)
    return ((torch.softmax(scores, -1) * has_key) @ vh).transpose(1, 2)


PATTERNS = [dict(local_window=1), dict(segment_blocks=3, dilation=2),
            dict(global_blocks=1, local_window=0),
            dict(block_layout=torch.rand(3, 6, 6, generator=torch.Generator().manual_seed(0)) < 0.3)]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_equals_dense_with_element_mask(pattern, causal, padded):
    torch.manual_seed(0)
    q, k, v = random_qkv(2, 24, 3, 4)
    mask = (torch.rand(2, 24) < 0.3) if padded else None
    module = BlockSparseDilatedAttention(4, **pattern)
    allowed = module.element_mask(24, 3, causal)[None].expand(2, -1, -1, -1)
    if padded:
        allowed = allowed & ~mask[:, None, None, :]
    g = torch.randn(2, 24, 3, 4, dtype=torch.float64)
    out, grads = outputs_and_grads(lambda *t: module(*t, is_causal=causal, key_padding_mask=mask),
                                   (q, k, v), g)
    ref, ref_grads = outputs_and_grads(lambda *t: _dense(*t, allowed), (q, k, v), g)
    assert max_error(out, ref) < 1e-10 and max_error(grads, ref_grads) < 1e-10


def test_all_blocks_active_equals_dense_attention():
    q, k, v = random_qkv(1, 16, 2, 4)
    module = BlockSparseDilatedAttention(4, block_layout=torch.ones(4, 4, dtype=torch.bool))
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    assert max_error(module(q, k, v), ref.transpose(1, 2)) < 1e-10


def test_computes_only_active_blocks():
    module = BlockSparseDilatedAttention(4, local_window=0)
    from attention.block_sparse import _active_index
    index, _ = _active_index(module.layout(8, 1), torch.device("cpu"))
    assert index.shape[-1] == 1  # one key block per query block, not eight


def test_invalid_arguments():
    with pytest.raises(ValueError, match="block_size"):
        BlockSparseDilatedAttention(0, local_window=1)
    with pytest.raises(ValueError, match="pattern"):
        BlockSparseDilatedAttention(4)
    q, k, v = random_qkv(1, 10, 1, 2)
    with pytest.raises(ValueError, match="multiple of block_size"):
        BlockSparseDilatedAttention(4, local_window=1)(q, k, v)


@pytest.mark.parametrize("module", ["block_sparse", "dilated"])
@pytest.mark.parametrize("scale", [0.0, -0.5, float("nan"), float("inf"), True, "0.5"])
def test_invalid_softmax_scale_names_the_fix(module, scale):
    """A scale that is not a positive finite number is refused when the module is built (it
    was taken by block-sparse and gave NaN or garbage outputs), the same way by both modules."""
    with pytest.raises(ValueError, match="softmax_scale must be a positive finite number"):
        if module == "block_sparse":
            BlockSparseDilatedAttention(4, local_window=1, softmax_scale=scale)
        else:
            DilatedAttention([4], [1], softmax_scale=scale)


def test_valid_softmax_scale_is_used():
    q, k, v = random_qkv(1, 8, 2, 4)
    module = BlockSparseDilatedAttention(4, block_layout=torch.ones(2, 2, dtype=torch.bool),
                                         softmax_scale=0.3)
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=0.3)
    assert max_error(module(q, k, v), ref.transpose(1, 2)) < 1e-10


def test_element_mask_of_a_partial_block_is_an_error():
    """forward refuses a sequence that is not a whole number of blocks; element_mask returned a
    (H, 8, 8) mask for seq_len 10 (the last two positions dropped) instead of saying so."""
    module = BlockSparseDilatedAttention(4, local_window=1)
    with pytest.raises(ValueError, match="seq length 10 must be a multiple of block_size 4"):
        module.element_mask(10, 2)
    assert module.element_mask(12, 2).shape == (2, 12, 12)


@pytest.mark.parametrize("inputs,mask,message", [
    ((1, 8, 2), None, r"query must be \(batch, seq, heads, head_dim\)"),
    ((1, 8, 2, 4), torch.zeros(1, 8), "key_padding_mask must be a bool tensor"),
    ((1, 8, 2, 4), torch.zeros(1, 4, dtype=torch.bool), r"key_padding_mask must be \(batch, seq\)"),
])
def test_invalid_inputs_name_the_fix(inputs, mask, message):
    """The same checks as ``DilatedAttention``, not an unpacking, view or ``~`` failure."""
    x = torch.zeros(inputs, dtype=torch.float64)
    with pytest.raises(ValueError, match=message):
        BlockSparseDilatedAttention(4, local_window=1)(x, x, x, key_padding_mask=mask)


@pytest.mark.parametrize("shape", [(0, 8, 2, 4), (2, 0, 2, 4)])
def test_empty_batch_or_sequence(shape):
    q, k, v = random_qkv(*shape)
    out = BlockSparseDilatedAttention(4, local_window=1)(q, k, v, is_causal=True)
    assert out.shape == shape
    out.sum().backward()
    assert q.grad.shape == shape


def test_strided_inputs_equal_contiguous_ones():
    """Batch-second tensors (``x.transpose(0, 1)`` of ``nn.MultiheadAttention``'s default layout),
    expanded and transposed inputs give what their contiguous copies give."""
    q, k, v = random_qkv(2, 24, 3, 4)
    strided = (q.detach().transpose(1, 2).contiguous().transpose(1, 2),  # (B, H, T, D) storage
               k.detach()[:1].expand(2, -1, -1, -1),
               v.detach().transpose(0, 1).contiguous().transpose(0, 1))  # (T, B, H, D) storage
    for pattern in (dict(local_window=1), dict(segment_blocks=2, dilation=2, global_blocks=1)):
        module = BlockSparseDilatedAttention(4, **pattern)
        for causal in (False, True):
            out = module(*strided, is_causal=causal)
            ref = module(*(t.contiguous() for t in strided), is_causal=causal)
            assert max_error(out, ref) < 1e-12
