"""More segments than one fused CUDA kernel call takes (``attention.kernel.CUDA_MAX_SEGMENTS``):
the calls are split along the segments, and each segment's numbers are those of one call.

Both fused kernels put the segment dimension on a grid axis of at most 65,535 blocks, so 65,536
segments of 8 tokens (512k tokens at rate 1) failed with "CUDA error: invalid argument". The
CPU tests below check the splitting itself, with a limit made small, on the CPU kernels; the GPU
tests run past the real limit (bf16/fp16 on torch's flash kernel, fp32 on the memory-efficient
one) against float64 on the same device."""
from __future__ import annotations

import os

import pytest
import torch

from attention import DilatedAttention
from attention import kernel
from attention_helpers import max_error

DEVICE = torch.device(os.environ.get("DISTFRAME_TEST_DEVICE", "cuda"))


@pytest.mark.parametrize("masked", [False, True])
def test_split_calls_equal_one_call(masked):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(11, 2, 8, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    key_mask = torch.rand(11, 2, 8, generator=gen) < 0.3 if masked else None
    grad_out = torch.randn(11, 2, 8, 8, dtype=torch.float64, generator=gen)
    whole = kernel._math_forward(q, k, v, True, key_mask, 0.5)
    grads = kernel._math_backward(grad_out, q, k, v, *whole, True, key_mask, 0.5)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel, "CUDA_MAX_SEGMENTS", 4)  # 11 segments: calls of 4, 4 and 3
        seen = []

        def forward(q, k, v, mask):
            seen.append(q.shape[0])
            return kernel._math_forward(q, k, v, True, mask, 0.5)
        split = kernel._in_batches(forward, (q, k, v), key_mask)
        split_grads = kernel._in_batches(lambda g, q, k, v, o, lse, mask: kernel._math_backward(
            g, q, k, v, o, lse, True, mask, 0.5), (grad_out, q, k, v, *whole), key_mask)
    assert seen == [4, 4, 3]
    exact = dict(rtol=0, atol=0, equal_nan=True)  # a row no key reaches: NaN gradients either way
    torch.testing.assert_close(split, whole, **exact)
    torch.testing.assert_close(split_grads, grads, **exact)


CASES = [  # name, seq, batch, dtype, padded, tolerance (out, grads)
    ("fp16, 65,536 segments", 8 * 65536, 1, torch.float16, False, (2e-3, 2e-2)),
    ("bf16, 70,000 segments and a ragged one", 8 * 70000 + 5, 1, torch.bfloat16, False, (2e-2, 1e-1)),
    ("fp16, 65,536 segments, padded keys", 8 * 65536, 1, torch.float16, True, (2e-3, 2e-2)),
    ("bf16, batch 2 x 40,000 segments", 8 * 40000, 2, torch.bfloat16, False, (2e-2, 1e-1)),
    ("fp32, 65,536 segments", 8 * 65536, 1, torch.float32, True, (1e-5, 1e-4)),
]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name, seq, batch, dtype, padded, tol", CASES, ids=[c[0] for c in CASES])
def test_past_the_kernel_grid_limit_equals_float64(name, seq, batch, dtype, padded, tol):
    gen = torch.Generator(DEVICE).manual_seed(0)
    q, k, v = (torch.randn(batch, seq, 1, 8, device=DEVICE, generator=gen).to(dtype) for _ in range(3))
    grad_out = torch.randn(batch, seq, 1, 8, device=DEVICE, generator=gen).to(dtype)
    mask = torch.rand(batch, seq, device=DEVICE, generator=gen) < 0.25 if padded else None
    attention = DilatedAttention(segment_lengths=[8], dilation_rates=[1])
    results = []
    for cast in (dtype, torch.float64):  # float64 runs the math kernel: the reference
        inputs = [t.to(cast).requires_grad_() for t in (q, k, v)]
        out = attention(*inputs, is_causal=True, key_padding_mask=mask)
        results.append((out, torch.autograd.grad(out, inputs, grad_out.to(cast))))
    (out, grads), (ref, ref_grads) = results
    assert max_error(out, ref) < tol[0]
    assert max_error(grads, ref_grads) < tol[1]
