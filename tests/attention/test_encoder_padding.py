"""MultiheadDilatedAttention as ``self_attn`` of nn.TransformerEncoder(Layer) with a padding mask.

torch turns the user's bool ``src_key_padding_mask`` into an additive float mask (0 to keep a
key, -inf to ignore it) before it calls ``self_attn``; nn.MultiheadAttention takes that form, and
so must a module documented to stand in for it. Other float values are an additive bias that
dilated attention cannot honour: refused, saying what to pass.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from attention import MultiheadDilatedAttention
from attention_helpers import copy_weights, max_error
from distframe.launch import spawn
from distframe.models.tensor_parallel_attention import TensorParallelDilatedAttention

EMBED, HEADS, SEQ = 16, 4, 12


def _layers() -> tuple[nn.TransformerEncoderLayer, nn.TransformerEncoderLayer]:
    """(ours, theirs): the same encoder layer, self_attn dilated (one full segment) or torch's."""
    torch.manual_seed(0)
    theirs = nn.TransformerEncoderLayer(EMBED, HEADS, 32, dropout=0.0, batch_first=True,
                                        dtype=torch.float64)
    ours = nn.TransformerEncoderLayer(EMBED, HEADS, 32, dropout=0.0, batch_first=True,
                                      dtype=torch.float64)
    ours.load_state_dict(theirs.state_dict())
    ours.self_attn = MultiheadDilatedAttention(EMBED, HEADS, segment_lengths=[SEQ], dilation_rates=[1],
                                               layer_norm=False, dtype=torch.float64)
    copy_weights(ours.self_attn, theirs.self_attn)
    return ours, theirs


def _padding() -> torch.Tensor:
    padding = torch.zeros(2, SEQ, dtype=torch.bool)  # True = a padded key, as torch has it
    padding[0, 8:] = True
    padding[1, 11:] = True
    return padding


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("train", [True, False])
def test_with_src_key_padding_mask_equals_nn_multihead_attention(causal, train):
    ours, theirs = _layers()
    x = torch.randn(2, SEQ, EMBED, dtype=torch.float64)
    # bool like the padding mask: torch deprecates mixing a bool and a float mask
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1) if causal else None
    padding = _padding()
    ours_stack, theirs_stack = (nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
                                for layer in (ours, theirs))
    for module in (ours, theirs, ours_stack, theirs_stack):
        module.train(train)
    stacked = {"mask": mask, "src_key_padding_mask": padding}
    assert max_error(ours_stack(x, **stacked), theirs_stack(x, **stacked)) < 1e-10
    single = {"src_mask": mask, "src_key_padding_mask": padding, "is_causal": causal}
    out, ref = ours(x, **single), theirs(x, **single)
    assert max_error(out, ref) < 1e-10
    g = torch.randn_like(out)
    grads = [torch.autograd.grad(y, list(layer.linear1.parameters()), g)
             for y, layer in ((out, ours), (ref, theirs))]
    assert max_error(grads[0], grads[1]) < 1e-10


def _additive(padding, dtype):
    """The float form of a bool padding mask that nn.TransformerEncoder passes on: 0 and -inf."""
    return torch.zeros(padding.shape, dtype=dtype).masked_fill(padding, float("-inf"))


def test_a_float_key_padding_mask_of_0_and_minus_inf_is_the_bool_mask():
    ours, _ = _layers()
    mha = ours.self_attn
    x = torch.randn(2, SEQ, EMBED, dtype=torch.float64)
    padding = _padding()
    additive = _additive(padding, torch.float32)
    expected, _ = mha(x, x, x, key_padding_mask=padding)
    assert torch.equal(mha(x, x, x, key_padding_mask=additive)[0], expected)


@pytest.mark.parametrize("bad", [0.5, float("inf"), float("nan"), -1e30])
def test_a_float_key_padding_mask_with_other_values_is_refused(bad):
    ours, _ = _layers()
    x = torch.randn(2, SEQ, EMBED, dtype=torch.float64)
    additive = torch.zeros(2, SEQ, dtype=torch.float64)
    additive[0, 3] = bad
    with pytest.raises(ValueError, match=r"key_padding_mask.*only 0.*-inf.*bool"):
        ours.self_attn(x, x, x, key_padding_mask=additive)


def test_an_integer_key_padding_mask_is_refused_naming_both_forms():
    ours, _ = _layers()
    x = torch.randn(2, SEQ, EMBED, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"key_padding_mask must be a bool tensor.*got torch.int64"):
        ours.self_attn(x, x, x, key_padding_mask=_padding().long())


def test_tensor_parallel_takes_the_float_mask_torch_passes():
    ours, _ = _layers()
    dense = ours.self_attn
    x = torch.randn(2, SEQ, EMBED, dtype=torch.float64)
    padding = _padding()
    additive = _additive(padding, torch.float64)
    expected, _ = dense(x, x, x, is_causal=True, key_padding_mask=padding)

    def run(backend):
        split = TensorParallelDilatedAttention(dense, backend)
        out, _ = split(x, x, x, is_causal=True, key_padding_mask=additive)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
        with pytest.raises(ValueError, match=r"key_padding_mask.*only 0.*-inf"):
            split(x, x, x, key_padding_mask=additive + 1.0)

    spawn(run, 2)
