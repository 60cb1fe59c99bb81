"""How the modules are called: argument kinds a torch user passes by habit, and autograd modes
(inference_mode, no_grad) mixed across calls of one module."""
from __future__ import annotations

import pytest
import torch

from attention import BlockSparseDilatedAttention, DilatedAttention, MultiheadDilatedAttention
from attention_helpers import random_qkv


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
