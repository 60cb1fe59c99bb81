"""MultiheadDilatedAttention parity with nn.MultiheadAttention, and the language model."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from attention import DilatedTransformerConfig, DilatedTransformerLM, MultiheadDilatedAttention
from attention_helpers import copy_weights, max_error


@pytest.mark.parametrize("causal", [False, True])
def test_equals_nn_multihead_attention(causal):
    torch.manual_seed(0)
    embed, heads, seq = 16, 4, 12
    ours = MultiheadDilatedAttention(embed, heads, segment_lengths=[seq], dilation_rates=[1],
                                     layer_norm=False, dtype=torch.float64)
    theirs = nn.MultiheadAttention(embed, heads, batch_first=True, dtype=torch.float64)
    copy_weights(ours, theirs)
    x = torch.randn(2, seq, embed, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, seq) < 0.3
    mask[:, 0] = False
    out, weights = ours(x, x, x, is_causal=causal, key_padding_mask=mask)
    attn_mask = nn.Transformer.generate_square_subsequent_mask(seq, dtype=torch.float64) \
        if causal else None
    ref, _ = theirs(x, x, x, key_padding_mask=mask, attn_mask=attn_mask, is_causal=causal)
    assert weights is None
    assert max_error(out, ref) < 1e-10
    g = torch.randn_like(out)
    assert max_error(torch.autograd.grad(out, x, g), torch.autograd.grad(ref, x, g)) < 1e-10


def _causal_masks(seq):
    return [nn.Transformer.generate_square_subsequent_mask(seq, dtype=torch.float64),
            torch.ones(seq, seq, dtype=torch.bool).triu(1)]


@pytest.mark.parametrize("kind", [0, 1])  # additive -inf above the diagonal; boolean True
@pytest.mark.parametrize("hint", [True, False])
def test_a_causal_attn_mask_is_taken_as_is_causal(kind, hint):
    """nn.TransformerEncoder passes the causal src mask as attn_mask (with is_causal as a hint):
    dilated attention refused any attn_mask. The causal mask is what is_causal=True does, so it
    is taken (checked to be causal, the hint or not); any other mask is still refused."""
    torch.manual_seed(0)
    embed, heads, seq = 16, 4, 12
    ours = MultiheadDilatedAttention(embed, heads, segment_lengths=[seq], dilation_rates=[1],
                                     layer_norm=False, dtype=torch.float64)
    x = torch.randn(2, seq, embed, dtype=torch.float64)
    out, _ = ours(x, x, x, attn_mask=_causal_masks(seq)[kind], is_causal=hint)
    assert torch.equal(out, ours(x, x, x, is_causal=True)[0])
    wrong = _causal_masks(seq + 1)[kind]
    with pytest.raises(ValueError, match=r"attn_mask.*\(12, 12\)"):
        ours(x, x, x, attn_mask=wrong, is_causal=hint)
    almost = _causal_masks(seq)[kind].clone()
    almost[3, 1] = True if kind else float("-inf")
    with pytest.raises(ValueError, match=r"takes no attn_mask"):
        ours(x, x, x, attn_mask=almost, is_causal=hint)


def test_in_a_causal_transformer_encoder_equals_nn_multihead_attention():
    torch.manual_seed(0)
    embed, heads, seq = 16, 4, 12
    theirs = nn.TransformerEncoderLayer(embed, heads, 32, dropout=0.0, batch_first=True,
                                        dtype=torch.float64)
    ours = nn.TransformerEncoderLayer(embed, heads, 32, dropout=0.0, batch_first=True, dtype=torch.float64)
    ours.load_state_dict(theirs.state_dict())
    ours.self_attn = MultiheadDilatedAttention(embed, heads, segment_lengths=[seq], dilation_rates=[1],
                                               layer_norm=False, batch_first=True, dtype=torch.float64)
    copy_weights(ours.self_attn, theirs.self_attn)
    x = torch.randn(2, seq, embed, dtype=torch.float64)
    mask = nn.Transformer.generate_square_subsequent_mask(seq, dtype=torch.float64)
    # TransformerEncoder detects the causal mask and passes it with is_causal=True; in eval mode
    # both check whether their fused fast path applies (it does not to ours).
    ours_stack, theirs_stack = (nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
                                for layer in (ours, theirs))
    for train in (True, False):
        ours_stack.train(train), theirs_stack.train(train)
        assert max_error(ours_stack(x, mask=mask), theirs_stack(x, mask=mask)) < 1e-10
        hinted = {"src_mask": mask, "is_causal": True}
        assert max_error(ours(x, **hinted), theirs(x, **hinted)) < 1e-10


def test_key_of_another_length_is_an_error_in_the_callers_shapes():
    """Dilated attention segments one sequence: cross-attention to a memory of another length is
    refused in the (batch, seq, embed_dim) shapes the caller passed, not the internal per-head ones."""
    mha = MultiheadDilatedAttention(16, 4, segment_lengths=[4], dilation_rates=[1])
    x, memory = torch.randn(2, 8, 16), torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"key and value must have the query's shape \(2, 8, 16\), "
                                         r"got key \(2, 5, 16\)"):
        mha(x, memory, memory)


def test_submodules_and_sub_layer_norm():
    mha = MultiheadDilatedAttention(32, 4, segment_lengths=[8, 16], dilation_rates=[1, 2],
                                    gamma_init=0.5)
    assert all(isinstance(getattr(mha, n), nn.Linear)
               for n in ("q_proj", "k_proj", "v_proj", "out_proj"))
    assert isinstance(mha.norm, nn.LayerNorm) and mha.num_heads == 4
    out, _ = mha(*(torch.randn(2, 16, 32),) * 3)
    assert out.shape == (2, 16, 32)


def test_language_model_shapes_causality_and_names():
    torch.manual_seed(0)
    model = DilatedTransformerLM(DilatedTransformerConfig.preset("tiny"))
    tokens = torch.randint(0, 256, (2, 64))
    logits = model(tokens)
    assert logits.shape == (2, 64, 256)
    changed = tokens.clone()
    changed[:, 40] = (changed[:, 40] + 1) % 256
    assert torch.equal(model(changed)[:, :40], logits[:, :40])
    names = dict(model.named_modules())
    assert "blocks.1.attn.q_proj" in names and "blocks.0.mlp.fc_in" in names
    assert isinstance(model.blocks, nn.ModuleList)
    assert model.head.weight is model.tok_embedding.weight
    logits.sum().backward()


def test_config_validation():
    with pytest.raises(ValueError, match="segment_lengths"):
        DilatedTransformerConfig.preset("tiny", seq_len=32)
    with pytest.raises(ValueError, match="num_heads"):
        DilatedTransformerConfig.preset("tiny", num_heads=3)
    with pytest.raises(ValueError, match="preset"):
        DilatedTransformerConfig.preset("huge")
    config = DilatedTransformerConfig.preset("small")
    with pytest.raises(Exception):
        config.seq_len = 5
    untied = DilatedTransformerLM(DilatedTransformerConfig.preset("tiny", tie_embeddings=False))
    assert untied.head.weight is not untied.tok_embedding.weight


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_heads=2.0), "num_heads must be a positive integer, got 2.0"),
    (dict(num_heads=True), "num_heads must be a positive integer, got True"),
    (dict(embed_dim=8.0), "embed_dim must be a positive integer, got 8.0"),
    (dict(num_heads="2"), "num_heads must be a positive integer, got '2'"),
    (dict(dropout=1.0), r"dropout must be a number in \[0, 1\), got 1.0"),
    (dict(dropout="0.1"), r"dropout must be a number in \[0, 1\), got '0.1'"),
])
def test_arguments_of_the_wrong_kind_are_an_error_naming_them(kwargs, message):
    """num_heads=2.0 built a module whose forward failed inside view() ('tuple of ints'),
    num_heads=True built one head, a string failed on '<='; a bad dropout was reported as
    attention_dropout, a name the caller never used."""
    arguments = {**dict(embed_dim=8, num_heads=2, segment_lengths=[4], dilation_rates=[1]),
                 **kwargs}
    with pytest.raises(ValueError, match=message):
        MultiheadDilatedAttention(**arguments)


def test_numpy_integer_head_counts_are_held_as_python_ints():
    mha = MultiheadDilatedAttention(np.int64(8), np.int32(2), segment_lengths=[4], dilation_rates=[1])
    assert (mha.embed_dim, mha.num_heads, mha.head_dim) == (8, 2, 4)
    assert all(type(n) is int for n in (mha.embed_dim, mha.num_heads, mha.head_dim))
