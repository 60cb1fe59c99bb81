"""Arguments a LongNet user gets wrong by habit: each is a ValueError that names the argument
and what to pass instead, not a torch or Python error from deep inside."""
from __future__ import annotations

import pytest
import torch

from attention import (BlockSparseDilatedAttention, DilatedAttention, MultiheadDilatedAttention,
                       RingDilatedAttention)


@pytest.mark.parametrize("make", [DilatedAttention,
                                  lambda s, r: RingDilatedAttention(s, r, backend=None)])
@pytest.mark.parametrize("segments,rates,name", [
    (2048, [1], "segment_lengths"),
    ([2048], 1, "dilation_rates"),
    (None, [1], "segment_lengths"),
])
def test_branches_given_as_one_number_name_the_argument(make, segments, rates, name):
    """LongNet's single-branch setting written as ``DilatedAttention(2048, 1)`` failed with
    "'int' object is not iterable", naming neither the argument nor the fix."""
    with pytest.raises(ValueError, match=rf"{name} must be a sequence of positive integers, one "
                                         r"per branch \(e\.g\. \[2048\] for one branch\)"):
        make(segments, rates)


@pytest.mark.parametrize("eps", [-1e-5, 0.0, float("nan"), float("inf"), True, "1e-5"])
def test_multihead_layer_norm_eps_must_be_positive(eps):
    """The sub-layer norm's eps was taken as given: -1e-5 or NaN gave NaN outputs without a
    word (the model's config already refuses such an eps)."""
    with pytest.raises(ValueError, match=r"layer_norm_eps must be a positive finite number"):
        MultiheadDilatedAttention(8, 2, segment_lengths=[4], dilation_rates=[1],
                                  layer_norm_eps=eps)


def test_multihead_input_of_another_width_names_embed_dim():
    """An input whose last dimension is not embed_dim failed in the projection with "mat1 and
    mat2 shapes cannot be multiplied (16x6 and 8x8)"."""
    mha = MultiheadDilatedAttention(8, 2, segment_lengths=[4], dilation_rates=[1])
    x = torch.randn(2, 8, 6)
    with pytest.raises(ValueError, match=r"query, key and value must be \(batch, seq, embed_dim="
                                         r"8\), got last dimension 6"):
        mha(x, x, x)


def test_block_sparse_dilation_without_segments_is_refused():
    """``dilation`` shapes only the dilated-segment pattern: without ``segment_blocks`` it was
    dropped without a word, so ``local_window=1, dilation=2`` computed a plain local window."""
    with pytest.raises(ValueError, match=r"dilation=2 applies to the dilated-segment pattern: "
                                         r"give segment_blocks too, or leave dilation at 1"):
        BlockSparseDilatedAttention(4, local_window=1, dilation=2)


@pytest.mark.parametrize("layout", [[[True, False], [True, True]], 1])
def test_block_sparse_layout_that_is_not_a_tensor_names_it(layout):
    """A nested list failed with "'list' object has no attribute 'dtype'"."""
    with pytest.raises(ValueError, match=r"block_layout must be a bool \(nb, nb\) or "
                                         r"\(heads, nb, nb\) tensor, got a"):
        BlockSparseDilatedAttention(4, block_layout=layout)


@pytest.mark.parametrize("kwargs,message", [
    (dict(total_heads=0), "total_heads must be a positive integer, got 0"),
    (dict(total_heads=4.0), "total_heads must be a positive integer, got 4.0"),
    (dict(total_heads=True), "total_heads must be a positive integer, got True"),
    (dict(head_start=1.5, total_heads=4),
     r"head_start must be an integer in 0..3 \(below total_heads\), got 1.5"),
])
def test_ring_head_placement_of_the_wrong_kind_names_it(kwargs, message):
    """total_heads=0 read "head_start=0 must lie in 0..-1"; a float total_heads or head_start
    was taken, and failed at the first forward with "'float' object cannot be interpreted as an
    integer"."""
    with pytest.raises(ValueError, match=message):
        RingDilatedAttention([4], [1], backend=None, **kwargs)


@pytest.mark.parametrize("gamma", [-1.0, float("nan"), "1.0", True])
def test_multihead_gamma_init_of_the_wrong_kind_names_it(gamma):
    """gamma_init went straight to ``nn.init.xavier_normal_``: -1.0 or NaN failed with "normal
    expects std >= 0.0", a string with "can't multiply sequence by non-int"."""
    with pytest.raises(ValueError, match=r"gamma_init must be a finite number >= 0"):
        MultiheadDilatedAttention(8, 2, segment_lengths=[4], dilation_rates=[1], gamma_init=gamma)


@pytest.mark.parametrize("tokens, error, words", [
    (torch.tensor([[1, 100]]), IndexError, "token ids in [1, 100], outside its vocabulary [0, 100)"),
    (torch.tensor([[-1, 2]]), IndexError, "token ids in [-1, 2], outside its vocabulary [0, 100)"),
    (torch.tensor([[1, 2]], dtype=torch.uint8), ValueError, "tokens must hold int64 or int32"),
    (torch.tensor([[1.0, 2.0]]), ValueError, "tokens must hold int64 or int32"),
])
def test_lm_token_ids_out_of_range_or_of_another_dtype_are_named(tokens, error, words):
    # They failed inside nn.Embedding ("index out of range in self", "Expected tensor for
    # argument #1 'indices' to have one of the following scalar types").
    from attention import DilatedTransformerConfig, DilatedTransformerLM
    lm = DilatedTransformerLM(DilatedTransformerConfig.preset("tiny", vocab_size=100))
    with pytest.raises(error) as info:
        lm(tokens)
    assert words in str(info.value)


@pytest.mark.parametrize("argument", ["query", "key_padding_mask"])
@pytest.mark.parametrize("convert", [lambda t: t.numpy(), lambda t: t.tolist()], ids=["numpy", "list"])
def test_inputs_that_are_not_tensors_are_named(argument, convert):
    # A numpy bool mask was refused as "must be a bool tensor ..., got bool"; a list, or a numpy
    # query, failed with AttributeError.
    x = torch.randn(1, 4, 2, 2)
    args = {"query": x, "key_padding_mask": torch.zeros(1, 4, dtype=torch.bool)}
    args[argument] = convert(args[argument])
    with pytest.raises(ValueError, match=rf"{argument} must be a torch.Tensor.*torch.as_tensor"):
        DilatedAttention([4], [1])(args["query"], x, x, key_padding_mask=args["key_padding_mask"])
