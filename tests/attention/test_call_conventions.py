"""How the modules are called: argument kinds a torch user passes by habit, and autograd modes
(inference_mode, no_grad) mixed across calls of one module."""
from __future__ import annotations

import pytest
import torch

from attention import (BlockSparseDilatedAttention, DilatedAttention, MultiheadDilatedAttention,
                       dense_dilated_attention)
from attention.pair_dropout import draw_seed
from attention.reference import dense_keep_mask
from attention_helpers import max_error, outputs_and_grads, random_qkv

TOL64 = 1e-10


@pytest.mark.parametrize("mask_shape", [(1, 1), (2, 8)])
@pytest.mark.parametrize("module", [
    DilatedAttention([4, 8], [1, 2]),
    BlockSparseDilatedAttention(4, local_window=1),
])
def test_a_mask_passed_as_is_causal_is_refused_naming_key_padding_mask(module, mask_shape):
    """``nn.MultiheadAttention`` takes the padding mask fourth; here that place is is_causal. A
    one-element mask was read as ``is_causal=True`` (a causal result, no error); a longer one
    failed with "Boolean value of Tensor ... is ambiguous"."""
    batch, seq = mask_shape[0], 8
    q, k, v = random_qkv(batch, seq, 2, 4)
    mask = torch.zeros(mask_shape, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"is_causal must be True or False, got a tensor of shape "
                                         r".*key_padding_mask="):
        module(q, k, v, mask)
    for not_bool in (1, None, "yes"):
        with pytest.raises(ValueError, match="is_causal must be True or False"):
            module(q, k, v, is_causal=not_bool)


def test_multihead_mask_passed_positionally_is_refused():
    mha = MultiheadDilatedAttention(8, 2, segment_lengths=[4], dilation_rates=[1])
    x = torch.randn(2, 8, 8)
    with pytest.raises(ValueError, match="key_padding_mask="):
        mha(x, x, x, torch.zeros(2, 8, dtype=torch.bool))


@pytest.mark.parametrize("seq", [16, 13])  # whole segments (strided views), ragged (index gathers)
@pytest.mark.parametrize("causal", [False, True])
def test_training_after_an_inference_mode_pass_equals_the_reference(seq, causal):
    """Index layouts are cached per shape; built during an evaluation under
    ``torch.inference_mode()`` they were inference tensors, and the next training forward with
    attention dropout raised "Inference tensors cannot be saved for backward". Training after
    such a pass equals the dense reference with the same dropout mask (float64, 1e-10)."""
    segments, rates, p, heads = [4, 8], [1, 2], 0.3, 4
    module = DilatedAttention(segments, rates, attention_dropout=p)
    q, k, v = random_qkv(2, seq, heads, 4, seed=seq)
    with torch.inference_mode():
        module.eval()(q, k, v, is_causal=causal)
    module.train()
    grad_out = torch.randn(2, seq, heads, 4, dtype=torch.float64)
    torch.manual_seed(5)
    keep = dense_keep_mask(draw_seed(None, q.device), 2, heads, seq, p)
    torch.manual_seed(5)  # the module draws the same seed
    out, grads = outputs_and_grads(lambda *t: module(*t, is_causal=causal), (q, k, v), grad_out)
    ref, ref_grads = outputs_and_grads(
        lambda *t: dense_dilated_attention(*t, segments, rates, is_causal=causal,
                                           dropout_keep=keep, dropout=p), (q, k, v), grad_out)
    assert max_error(out, ref) < TOL64
    assert max_error(grads, ref_grads) < TOL64


@pytest.mark.parametrize("module", [DilatedAttention([4, 8], [1, 2]),
                                    BlockSparseDilatedAttention(4, local_window=1)])
def test_a_mask_on_another_device_is_an_error_naming_it(module):
    """As q, k and v: a mask elsewhere failed deep inside ("Tensor on device cpu is not on the
    expected device meta!") or, on a GPU with whole segments, was copied in silently."""
    q, k, v = random_qkv(2, 8, 2, 4)
    mask = torch.zeros(2, 8, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match="key_padding_mask device meta differs from query device "
                                         "cpu: move the mask"):
        module(q, k, v, key_padding_mask=mask)


def test_multihead_takes_nn_multihead_attention_keywords():
    """Code written for nn.MultiheadAttention (nn.TransformerEncoderLayer passes attn_mask=None,
    need_weights=False) failed with "unexpected keyword argument"; what dilated attention can do
    is taken, the rest refused saying what to pass instead."""
    mha = MultiheadDilatedAttention(8, 2, segment_lengths=[4], dilation_rates=[1], batch_first=True)
    x = torch.randn(2, 8, 8)
    out, weights = mha(x, x, x, attn_mask=None, need_weights=False, average_attn_weights=True)
    assert weights is None and torch.equal(out, mha(x, x, x)[0]) and mha.batch_first
    with pytest.raises(ValueError, match=r"forms no attention weights.*need_weights=False"):
        mha(x, x, x, need_weights=True)
    with pytest.raises(ValueError, match=r"attn_mask.*is_causal=True.*key_padding_mask"):
        mha(x, x, x, attn_mask=torch.ones(8, 8, dtype=torch.bool).triu(2))  # not the causal mask
    with pytest.raises(ValueError, match=r"batch_first=False.*transpose\(0, 1\)"):
        MultiheadDilatedAttention(8, 2, segment_lengths=[4], dilation_rates=[1], batch_first=False)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("seq", [13, 16, 3])
def test_meta_tensors_give_the_output_shape(seq, is_causal):
    """Shape inference on the meta device (as torch.distributed.pipelining's stages do, and as
    F.scaled_dot_product_attention supports) failed on a sequence that is no multiple of the
    segments: the plan asked its meta positions for values ("Tensor.item() cannot be called on
    meta tensors", then ``nonzero``). A ragged plan now builds its layout on the CPU."""
    q = torch.empty(2, seq, 4, 8, device="meta")
    mask = torch.zeros(2, seq, dtype=torch.bool, device="meta")
    out = DilatedAttention([4, 8], [1, 2])(q, q, q, is_causal=is_causal, key_padding_mask=mask)
    assert out.shape == q.shape and out.device.type == "meta"
    mha = MultiheadDilatedAttention(32, 4, segment_lengths=[4, 8], dilation_rates=[1, 2],
                                    device="meta")
    x = torch.empty(2, seq, 32, device="meta")
    assert mha(x, x, x, is_causal=is_causal)[0].shape == x.shape
