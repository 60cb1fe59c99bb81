"""DilatedAttention against the dense ``log C`` reference: forward and gradients, float64 1e-10."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from attention import (BlockSparseDilatedAttention, DilatedAttention, MultiheadDilatedAttention,
                       dense_dilated_attention)
from attention.autograd_path import dilated_attention_autograd
from attention_helpers import max_error, outputs_and_grads, random_qkv

TOL64 = 1e-10
TOL32 = 1e-5

GRID = [
    # segments, rates, heads, seq
    ((4,), (1,), 2, 8),
    ((4, 8), (1, 2), 4, 16),
    ((4, 8), (1, 2), 4, 13),          # ragged last segment
    ((3, 6, 12), (1, 2, 4), 3, 17),   # heads not divisible by rate
    ((8, 16, 32), (1, 2, 4), 5, 20),  # segments longer than the sequence
    ((30,), (3,), 3, 10),             # cut segment not divisible by its rate
    ((2, 4, 8), (2, 4, 8), 8, 24),    # every branch dilated
    ((4, 8, 16), (1, 2, 4), 4, 32),
]


def _compare(segments, rates, heads, seq, causal, padded, seed=0, batch=2, dim=4):
    q, k, v = random_qkv(batch, seq, heads, dim, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    mask = (torch.rand(batch, seq, generator=gen) < 0.3) if padded else None
    grad_out = torch.randn(batch, seq, heads, dim, dtype=torch.float64, generator=gen)
    module = DilatedAttention(segments, rates)
    out, grads = outputs_and_grads(
        lambda *t: module(*t, is_causal=causal, key_padding_mask=mask), (q, k, v), grad_out)
    ref, ref_grads = outputs_and_grads(
        lambda *t: dense_dilated_attention(*t, segments, rates, is_causal=causal,
                                           key_padding_mask=mask), (q, k, v), grad_out)
    assert max_error(out, ref) < TOL64
    assert max_error(grads, ref_grads) < TOL64


@pytest.mark.parametrize("segments,rates,heads,seq", GRID)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_matches_dense_reference(segments, rates, heads, seq, causal, padded):
    _compare(segments, rates, heads, seq, causal, padded)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_matches_dense_reference_hypothesis(data):
    branches = data.draw(st.integers(1, 3))
    rates = [data.draw(st.sampled_from([1, 2, 3, 4])) for _ in range(branches)]
    segments = [r * data.draw(st.integers(1, 6)) for r in rates]
    _compare(segments, rates, heads=data.draw(st.integers(1, 6)), seq=data.draw(st.integers(1, 30)),
             causal=data.draw(st.booleans()), padded=data.draw(st.booleans()),
             seed=data.draw(st.integers(0, 1000)), batch=data.draw(st.integers(1, 2)))


@pytest.mark.parametrize("causal", [False, True])
def test_one_full_branch_equals_sdpa(causal):
    q, k, v = random_qkv(2, 16, 4, 8)
    out = DilatedAttention([16], [1])(q, k, v, is_causal=causal)
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                         is_causal=causal).transpose(1, 2)
    assert max_error(out, ref) < TOL64


def test_rate_one_segments_equal_block_diagonal_attention():
    q, k, v = random_qkv(1, 12, 2, 4)
    block = torch.block_diag(*[torch.ones(4, 4, dtype=torch.bool)] * 3)
    out = DilatedAttention([4], [1])(q, k, v)
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                         attn_mask=block).transpose(1, 2)
    assert max_error(out, ref) < TOL64


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = random_qkv(1, 8, 2, 4)
    mask = torch.ones(1, 8, dtype=torch.bool)
    out = DilatedAttention([4, 8], [1, 2])(q, k, v, key_padding_mask=mask)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_gradcheck():
    q, k, v = random_qkv(1, 10, 3, 3)
    module = DilatedAttention([4, 8], [1, 2])
    assert torch.autograd.gradcheck(lambda *t: module(*t, is_causal=True), (q, k, v))


@pytest.mark.parametrize("fused", [True, False])
def test_double_backward_is_exact(fused, monkeypatch):
    """The kernels' backward is not itself differentiable: the math kernel (float64 on a GPU, odd
    head sizes) gave wrong second derivatives silently (errors of 0.5 against the dense
    reference), the fused one an error about an aten op. A differentiable backward now computes
    them through autograd ([Note: double backward] in attention/function.py), exact on both."""
    if not fused:
        monkeypatch.setattr("attention.kernel._use_cpu_flash", lambda q: False)
    q, k, v = random_qkv(1, 6, 2, 3)

    def second(attention):
        grad_q, = torch.autograd.grad((attention(q, k, v) ** 2).sum(), q, create_graph=True)
        return torch.autograd.grad(grad_q.sum(), (q, k, v))

    module = DilatedAttention([4], [1])
    dense = second(lambda a, b, c: dense_dilated_attention(a, b, c, [4], [1]))
    assert max_error(second(module), dense) < TOL64


def test_autograd_path_matches_function():
    q, k, v = random_qkv(2, 13, 4, 4)
    module = DilatedAttention([4, 8], [1, 2])
    sources = module._key_sources(13, 4, q.device, True)
    ref = module(q, k, v, is_causal=True)
    out = dilated_attention_autograd(q, k, v, sources, is_causal=True, key_padding_mask=None,
                                     scale=0.5, dropout=0.0)
    assert max_error(out, ref) < TOL64


def test_dropout_trains_and_eval_is_deterministic():
    torch.manual_seed(0)
    q, k, v = random_qkv(1, 16, 2, 4, dtype=torch.float32)
    module = DilatedAttention([8], [1], attention_dropout=0.5)
    module.train()
    a = module(q, k, v)
    a.sum().backward()
    module.eval()
    assert torch.equal(module(q, k, v), module(q, k, v))
    assert not torch.allclose(a, module(q, k, v))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, TOL32), (torch.bfloat16, 5e-2),
                                       (torch.float16, 5e-3)])
def test_low_precision_dtypes(dtype, tol):
    q, k, v = random_qkv(2, 24, 4, 8)
    module = DilatedAttention([8, 16], [1, 2])
    ref = module(q, k, v, is_causal=True)
    low = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = module(*low, is_causal=True)
    assert out.dtype == dtype
    assert max_error(out, ref) < tol
    out.float().sum().backward()
    assert all(t.grad.dtype == dtype and torch.isfinite(t.grad.float()).all() for t in low)


@pytest.mark.parametrize("kwargs,name", [
    (dict(segment_lengths=[4, 8], dilation_rates=[1]), "same length"),
    (dict(segment_lengths=[0], dilation_rates=[1]), "segment_lengths"),
    (dict(segment_lengths=[4], dilation_rates=[-1]), "dilation_rates"),
    (dict(segment_lengths=[6], dilation_rates=[4]), "divisible"),
    (dict(segment_lengths=[4], dilation_rates=[1], attention_dropout=1.5), "attention_dropout"),
])
def test_invalid_configuration(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DilatedAttention(**kwargs)


def test_numpy_integer_branches_are_accepted():
    """Segment lengths read from a config as numpy integers are integers: the module equals the
    one built from Python ints (and holds Python ints); bools and floats stay refused."""
    q, k, v = random_qkv(1, 16, 4, 4)
    module = DilatedAttention(np.array([4, 8]), [np.int64(1), np.int32(2)])
    assert module.segment_lengths == (4, 8) and module.dilation_rates == (1, 2)
    assert all(type(n) is int for n in module.segment_lengths + module.dilation_rates)
    ref = dense_dilated_attention(q, k, v, [4, 8], [1, 2])
    assert max_error(module(q, k, v), ref) < TOL64
    for bad in ([True], [4.0], [np.float64(4)], [np.bool_(True)]):
        with pytest.raises(ValueError, match="segment_lengths must hold positive integers"):
            DilatedAttention(bad, [1])


def test_head_dim_mismatch():
    q, k, v = random_qkv(1, 8, 2, 4)
    with pytest.raises(ValueError, match="head_dim"):
        DilatedAttention([4], [1])(q, k[..., :3], v)


def test_mixed_dtypes_are_an_error_that_names_them():
    """As SDPA: q, k and v share a dtype; the error says which differs (not a matmul failure)."""
    q, k, v = random_qkv(1, 8, 2, 4)
    with pytest.raises(ValueError, match="key dtype torch.float32 differs from query dtype "
                                         "torch.float64"):
        DilatedAttention([4], [1])(q, k.float(), v)


@pytest.mark.parametrize("module", [DilatedAttention([4], [1]),
                                    BlockSparseDilatedAttention(2, local_window=1)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8])
def test_integer_inputs_are_an_error_naming_the_dtype(module, dtype):
    """As SDPA: attention needs floating-point q, k, v. DilatedAttention computed in float32 and
    cast the output back to the integers, truncated without a word ([1, 3, ...] where the
    weighted means are [1.0003, 3.514, ...]); the block-sparse one failed inside SDPA."""
    q, k, v = (torch.randint(0, 5, (1, 4, 1, 2), dtype=dtype) for _ in range(3))
    with pytest.raises(ValueError, match=f"query dtype {dtype} is not a floating-point dtype"):
        module(q, k, v)


@pytest.mark.parametrize("shape", [(0, 8, 2, 4), (2, 0, 2, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_empty_batch_or_sequence(shape, causal):
    """As ``nn.MultiheadAttention`` and SDPA do: an empty output, and gradients that flow."""
    q, k, v = random_qkv(*shape)
    mask = torch.zeros(shape[:2], dtype=torch.bool)
    out = DilatedAttention([4, 8], [1, 2])(q, k, v, is_causal=causal, key_padding_mask=mask)
    assert out.shape == shape
    out.sum().backward()
    assert q.grad.shape == shape and k.grad.shape == shape
    mha = MultiheadDilatedAttention(8, 2, segment_lengths=[4, 8], dilation_rates=[1, 2],
                                    dtype=torch.float64)
    x = torch.randn(shape[0], shape[1], 8, dtype=torch.float64)
    assert mha(x, x, x, is_causal=causal)[0].shape == x.shape


def test_layouts_kept_for_a_few_sequence_lengths_only():
    """Index layouts are cached per sequence length; a model fed many lengths (generation,
    variable-length batches) keeps only the most recent few, and evicted ones are rebuilt."""
    module = DilatedAttention([4, 8], [1, 2])
    first = random_qkv(1, 3, 2, 4)
    with torch.no_grad():
        for seq in range(3, 60):
            module(*random_qkv(1, seq, 2, 4), is_causal=True)
        assert len(module._sources) <= 8
        out = module(*first, is_causal=True)
        assert max_error(out, dense_dilated_attention(*first, [4, 8], [1, 2], is_causal=True)) < TOL64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_holds_the_accumulator_and_one_unit_beyond_its_inputs(dtype):
    """Live storage that the forward creates, counted from real storages: the fp32 accumulator
    (which becomes the output in fp32), one unit's kernel output and the smaller units' merge
    products, at most 2.5x the fp32 output's size. The first branch's units are written into the
    accumulator, later units merged into it in place; merging every unit through new tensors
    held about 5x (three temporaries of the first unit's size besides its output)."""
    from attention_helpers import NewStoragePeak
    q, k, v = (t.detach().to(dtype) for t in random_qkv(2, 256, 4, 16))
    module = DilatedAttention((32, 64, 128), (1, 2, 4))
    fp32_output = q.numel() * 4
    with torch.no_grad(), NewStoragePeak(q, k, v) as meter:
        module(q, k, v, is_causal=True)
    assert fp32_output < meter.peak <= 2.5 * fp32_output, meter.peak / fp32_output


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("causal,padded", [(True, False), (False, True)])
def test_units_in_parts_give_the_numbers_of_whole_units(monkeypatch, dtype, causal, padded):
    """[Note: units in parts]: a unit whose kernel output exceeds PART_BYTES runs in parts of its
    segments; with parts of one segment each, outputs and gradients are bitwise those of whole
    units (each element is computed alike)."""
    import attention.function
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in random_qkv(2, 64, 4, 8))
    mask = (torch.rand(2, 64, generator=torch.Generator().manual_seed(3)) < 0.3) if padded else None
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    module = DilatedAttention((8, 16, 64), (1, 2, 4))
    runs = []
    for part_bytes in (1 << 40, 1):
        monkeypatch.setattr(attention.function, "PART_BYTES", part_bytes)
        runs.append(outputs_and_grads(lambda *t: module(*t, is_causal=causal, key_padding_mask=mask),
                                      (q, k, v), grad_out))
    (whole, whole_grads), (parts, parts_grads) = runs
    assert torch.equal(parts, whole)
    assert all(torch.equal(a, b) for a, b in zip(parts_grads, whole_grads))


def test_backward_holds_the_gradient_accumulators_and_one_part(monkeypatch):
    """Live storage of forward and backward beyond q, k, v and the incoming gradient, counted from
    real storages, with parts of an eighth of the output: the output, the three fp32 gradient
    accumulators (which become the gradients) and one part's kernel gradients, at most 4.75x the
    output (whole units held 7x: the first unit's three kernel gradients besides the accumulators)."""
    import attention.function
    from attention_helpers import NewStoragePeak
    q, k, v = (t.detach().float().requires_grad_() for t in random_qkv(2, 256, 4, 16))
    grad_out = torch.randn(q.shape)
    module = DilatedAttention((32, 64, 128), (1, 2, 4))
    output = q.numel() * 4
    monkeypatch.setattr(attention.function, "PART_BYTES", output // 8)
    with NewStoragePeak(q, k, v, grad_out) as meter:
        module(q, k, v, is_causal=True).backward(grad_out)
    assert 4 * output < meter.peak <= 4.75 * output, meter.peak / output
