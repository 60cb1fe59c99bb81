"""The segment kernel's fused paths against its plain math kernel in float64.

``segment_attention_forward``/``backward`` pick a fused kernel by device and dtype (CPU flash;
CUDA flash or memory-efficient, ``attention/kernel.py``). Each is checked against
``_math_forward``/``_math_backward`` run in float64 on the *same rounded inputs*, so the error
left is the fused kernel's own arithmetic: with unit-normal inputs, max absolute error below
1e-12 (float64), 2e-6 (float32), 4e-3 (float16) and 3e-2 (bfloat16) for outputs and 4x that
for gradients. Cases: causal or not, ignored keys (with rows that see no key at all), and the
backward handed a *merged* output and log-sum-exp with rows at ``lse = +inf`` (what
``attention/function.py`` passes; those rows must get zero gradient).

The CUDA cases are marked ``gpu`` and skip without a CUDA device. The CPU checks the trick the
CUDA kernels use for masks (appended channels) with its own fused kernel.
"""
from __future__ import annotations

import math

import pytest
import torch

from attention.kernel import (_masked_inputs, _math_backward, _math_forward, cuda_kernel,
                              segment_attention_backward, segment_attention_forward)

TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 4e-3,
             torch.bfloat16: 3e-2}
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def _inputs(dtype, device, n=3, heads=2, rows=37, dim=64, masked=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(n, heads, rows, dim, generator=gen).to(device, dtype)
                     for _ in range(4))
    key_mask = None
    if masked:
        key_mask = torch.rand(n, heads, rows, generator=gen) < 0.3
        key_mask[0, 0] = True  # no key at all for these rows
        key_mask[1, 1, :5] = True  # causal rows 0-4 see no key
        key_mask = key_mask.to(device)
    return q, k, v, grad, key_mask


def _float64(*tensors):
    return [None if t is None else t.double() for t in tensors]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_forward_equals_the_math_kernel_in_float64(device, dtype, causal, masked):
    q, k, v, _, key_mask = _inputs(dtype, device, masked=masked)
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = segment_attention_forward(q, k, v, is_causal=causal, key_mask=key_mask,
                                         scale=scale)
    ref_out, ref_lse = _math_forward(*_float64(q, k, v), causal, key_mask, scale)
    assert out.dtype == dtype and out.device.type == device
    tol = TOLERANCE[dtype]
    assert (out.double() - ref_out).abs().max().item() < tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)  # -inf exactly where no key is seen
    assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() < tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_backward_with_a_merged_output_equals_the_math_kernel(device, dtype, causal, masked):
    q, k, v, grad, key_mask = _inputs(dtype, device, masked=masked, seed=1)
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = _math_forward(*_float64(q, k, v), causal, key_mask, scale)
    # As if another branch had been merged in: a larger lse, a different output, and rows
    # the unit must not touch at +inf.
    gen = torch.Generator().manual_seed(2)
    other = torch.randn(lse.shape, generator=gen, dtype=torch.float64).to(device)
    merged_lse = torch.logaddexp(lse, other)
    merged_lse[:, :, :3] = float("inf")
    merged_lse = merged_lse.masked_fill(torch.isneginf(merged_lse), float("inf"))
    weight = torch.exp(lse - merged_lse).nan_to_num(0.0).unsqueeze(-1)
    merged_out = (weight * out + (1 - weight) * torch.randn(out.shape, generator=gen,
                                                            dtype=torch.float64).to(device))
    merged_out = merged_out.to(dtype)
    lse_in = merged_lse.to(torch.float64 if dtype == torch.float64 else torch.float32)
    grads = segment_attention_backward(grad, q, k, v, merged_out, lse_in, is_causal=causal,
                                       key_mask=key_mask, scale=scale)
    ref = _math_backward(*_float64(grad, q, k, v, merged_out, lse_in), causal, key_mask, scale)
    tol = 4 * TOLERANCE[dtype]
    for got, want in zip(grads, ref):
        assert got.dtype == dtype and got.shape == want.shape
        assert (got.double() - want).abs().max().item() < tol
    assert grads[0][:, :, :3].abs().max().item() == 0  # rows at +inf get no gradient


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_appended_channels_ignore_exactly_the_masked_keys(dtype, causal):
    """The fused CUDA kernels take no mask; ``_masked_inputs`` lowers ignored keys through
    appended channels instead. Checked here on the CPU kernel, unmasked, against the math
    kernel with the mask (rows that see no key excepted: the caller sets those)."""
    q, k, v, _, key_mask = _inputs(dtype, "cpu", masked=True, seed=3)
    scale = 1 / math.sqrt(q.shape[-1])
    qa, ka, va = _masked_inputs(q, k, v, key_mask, scale)
    assert qa.shape[-1] == q.shape[-1] + 8 and torch.equal(qa[..., :64], q)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qa, ka, va, 0.0, causal, scale=scale)
    ref_out, ref_lse = _math_forward(*_float64(q, k, v), causal, key_mask, scale)
    seen = torch.isfinite(ref_lse)
    tol = TOLERANCE[dtype]
    assert (out[..., :64].double() - ref_out)[seen].abs().max().item() < tol
    assert (lse.double() - ref_lse)[seen].abs().max().item() < tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cuda_kernel_choice():
    cuda = torch.device("cuda")
    mask = torch.zeros(1, 1, 8, dtype=torch.bool, device=cuda)
    flash = "flash" if torch.cuda.get_device_capability(cuda) >= (8, 0) else None
    cases = [(torch.bfloat16, 64, None, 0.125, flash), (torch.float16, 64, mask, 0.125, flash),
             (torch.float32, 64, mask, 0.125, "efficient"), (torch.float64, 64, None, 0.125, None),
             (torch.float32, 4, None, 0.5, None), (torch.bfloat16, 256, None, 0.06, flash),
             (torch.bfloat16, 256, mask, 0.06, None), (torch.bfloat16, 320, None, 0.05, None),
             (torch.float16, 64, mask, 1e-12, None), (torch.float16, 64, None, 1e-12, flash)]
    for dtype, dim, key_mask, scale, want in cases:
        q = torch.zeros(1, 1, 8, dim, dtype=dtype, device=cuda)
        assert cuda_kernel(q, key_mask, scale) == want, (dtype, dim, key_mask is not None, scale)
    assert cuda_kernel(torch.zeros(1, 1, 8, 64), None, 0.125) is None  # CPU tensors
