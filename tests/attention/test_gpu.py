"""The attention variants on a CUDA device against the plain references: dilated attention
(float64 1e-10 against the dense reference on the CPU; float32, bfloat16 and float16 against the
float64 result at stated tolerances, at a short and a long sequence), ring attention over
in-memory ranks sharing the GPU (forward; its backward needs one process per GPU), block-sparse
attention and the LM (the GPU run equals the CPU
run in float64).

Needs a CUDA device; skipped elsewhere (``DISTFRAME_TEST_DEVICE=cpu`` runs the same checks on
the CPU, to try the tests themselves on a machine without a GPU)."""
from __future__ import annotations

import os
import time

import pytest
import torch

from attention import (BlockSparseDilatedAttention, DilatedAttention, RingDilatedAttention,
                       dense_dilated_attention)
from attention.model import DilatedTransformerConfig, DilatedTransformerLM
from attention_helpers import max_error, outputs_and_grads, random_qkv
from test_ring import RingRank
from distframe.errors import CollectiveTimeoutError
from distframe.launch import spawn

DEVICE = torch.device(os.environ.get("DISTFRAME_TEST_DEVICE", "cuda"))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")]
TOL64 = 1e-10


def to_device(tensors, dtype=None):
    return [t.detach().to(DEVICE, dtype).requires_grad_() for t in tensors]


def reference_on_cpu(fn, tensors, grad_out):
    """Output and input gradients of ``fn`` on the CPU float64 copies of ``tensors``."""
    return outputs_and_grads(fn, [t.detach().cpu().double().requires_grad_() for t in tensors],
                             grad_out.cpu().double())


@pytest.mark.parametrize("segments,rates,heads,seq", [
    ((4, 8), (1, 2), 4, 13), ((3, 6, 12), (1, 2, 4), 3, 17), ((2, 4, 8), (2, 4, 8), 8, 24)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_dilated_float64_equals_the_dense_reference(segments, rates, heads, seq, causal, padded):
    q, k, v = random_qkv(2, seq, heads, 4)
    gen = torch.Generator().manual_seed(1)
    mask = (torch.rand(2, seq, generator=gen) < 0.3) if padded else None
    grad_out = torch.randn(2, seq, heads, 4, dtype=torch.float64, generator=gen)
    module = DilatedAttention(segments, rates)
    out, grads = outputs_and_grads(
        lambda *t: module(*t, is_causal=causal,
                          key_padding_mask=None if mask is None else mask.to(DEVICE)),
        to_device((q, k, v)), grad_out.to(DEVICE))
    assert out.device.type == DEVICE.type and all(g.device.type == DEVICE.type for g in grads)
    ref, ref_grads = reference_on_cpu(
        lambda *t: dense_dilated_attention(*t, segments, rates, is_causal=causal,
                                           key_padding_mask=mask), (q, k, v), grad_out)
    assert max_error(out.cpu(), ref) < TOL64
    assert max_error([g.cpu() for g in grads], ref_grads) < TOL64


# Tolerances of a low-precision GPU result against float64, max absolute error: inputs are unit
# normals, so outputs are averages of values of size ~1. bfloat16 keeps 8 bits of mantissa
# (relative error 2^-8 ~ 4e-3 per rounding), float16 11 bits.
LOW_PRECISION = [(torch.float32, 1e-5, 1e-4), (torch.bfloat16, 5e-2, 1e-1), (torch.float16, 5e-3, 2e-2)]


@pytest.mark.parametrize("dtype,tol_out,tol_grad", LOW_PRECISION)
@pytest.mark.parametrize("batch,seq,heads,dim,segments,rates", [
    (2, 24, 4, 8, (8, 16), (1, 2)),
    (1, 2048, 8, 64, (256, 512, 1024, 2048), (1, 2, 4, 8)),
    (2, 1000, 4, 64, (128, 256, 512), (1, 2, 4))])  # ragged: the last segments are cut short
@pytest.mark.parametrize("padded", [False, True])
def test_low_precision_against_float64(dtype, tol_out, tol_grad, batch, seq, heads, dim,
                                       segments, rates, padded):
    """Covers both fused CUDA kernels: flash (half precision) and memory-efficient (float32),
    with and without ignored keys (padding, or a cut-short segment), which reach them through
    appended channels."""
    q, k, v = random_qkv(batch, seq, heads, dim)
    gen = torch.Generator().manual_seed(2)
    grad_out = torch.randn(batch, seq, heads, dim, dtype=torch.float64, generator=gen)
    mask = (torch.rand(batch, seq, generator=gen) < 0.2).to(DEVICE) if padded else None
    module = DilatedAttention(segments, rates)

    def run(*t):
        return module(*t, is_causal=True, key_padding_mask=mask)

    ref, ref_grads = outputs_and_grads(run, to_device((q, k, v)), grad_out.to(DEVICE))
    out, grads = outputs_and_grads(run, to_device((q, k, v), dtype), grad_out.to(DEVICE, dtype))
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert max_error(out, ref) < tol_out
    assert max_error(grads, ref_grads) < tol_grad


@pytest.mark.skipif(DEVICE.type == "cpu", reason="the limit is the GPU's autograd thread")
def test_ring_over_ranks_sharing_a_gpu_stops_at_once_saying_why():
    """Ring attention exchanges keys inside backward; torch runs every thread's backward on one
    autograd thread per GPU, so in-memory ranks sharing one GPU cannot (docs/design.md). One
    process per GPU (NCCL) can; here the shared-GPU run must stop at once (not at the 60 s
    timeout) with an error that says why."""
    q, k, v = to_device(random_qkv(2, 24, 4, 4))
    grad_out = torch.ones(2, 24, 4, 4, dtype=torch.float64, device=DEVICE)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="autograd thread for cuda"):
        spawn(RingRank((2, (8, 16), (1, 2), 24, 4, True, False), (q, k, v, grad_out, None)), 2,
              timeout=60)
    assert time.monotonic() - start < 20


def test_ring_forward_over_ranks_sharing_the_gpu_equals_one_device():
    """The forward alone (no backward) runs on ranks sharing a GPU: each rank's slice equals the
    single-device output, float64 1e-10."""
    q, k, v = (t.detach() for t in to_device(random_qkv(2, 24, 4, 4)))
    ref = DilatedAttention((4, 8, 16), (1, 2, 4))(q, k, v)

    def run(backend):
        local = 24 // backend.world_size
        part = slice(backend.rank * local, (backend.rank + 1) * local)
        with torch.no_grad():
            return RingDilatedAttention((4, 8, 16), (1, 2, 4), backend=backend)(
                q[:, part], k[:, part], v[:, part])

    out = torch.cat(spawn(run, 4, timeout=30), dim=1)
    assert out.device.type == DEVICE.type
    assert max_error(out, ref) < TOL64


@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_on_the_gpu_equals_the_cpu(causal):
    q, k, v = random_qkv(2, 24, 3, 4)
    mask = torch.rand(2, 24, generator=torch.Generator().manual_seed(4)) < 0.3
    grad_out = torch.randn(2, 24, 3, 4, dtype=torch.float64)
    module = BlockSparseDilatedAttention(4, segment_blocks=3, dilation=2, global_blocks=1)
    out, grads = outputs_and_grads(
        lambda *t: module(*t, is_causal=causal, key_padding_mask=mask.to(DEVICE)),
        to_device((q, k, v)), grad_out.to(DEVICE))
    ref, ref_grads = reference_on_cpu(
        lambda *t: module(*t, is_causal=causal, key_padding_mask=mask), (q, k, v), grad_out)
    assert out.device.type == DEVICE.type
    assert max_error(out.cpu(), ref) < TOL64
    assert max_error([g.cpu() for g in grads], ref_grads) < TOL64


def test_language_model_on_the_gpu_equals_the_cpu():
    config = DilatedTransformerConfig.preset("tiny", seq_len=32, embed_dim=32, num_heads=4,
                                             num_layers=2, segment_lengths=(8, 16, 32),
                                             dilation_rates=(1, 2, 4))
    torch.manual_seed(0)
    cpu_model = DilatedTransformerLM(config).double()
    gpu_model = DilatedTransformerLM(config).double().to(DEVICE)
    gpu_model.load_state_dict(cpu_model.state_dict())
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(5))
    cpu_logits = cpu_model(tokens)
    gpu_logits = gpu_model(tokens.to(DEVICE))
    assert gpu_logits.device.type == DEVICE.type
    assert max_error(gpu_logits.cpu(), cpu_logits) < TOL64
    cpu_logits.logsumexp(-1).sum().backward()
    gpu_logits.logsumexp(-1).sum().backward()
    gpu_grads = dict(gpu_model.named_parameters())
    for name, p in cpu_model.named_parameters():
        assert max_error(gpu_grads[name].grad.cpu(), p.grad) < TOL64, name
