"""Segment attention kernel: ``(q, k, v) -> (out, lse)`` and its backward.

Inputs are batches of compressed (dilated) segments ``(N, H, M, D)``. The forward returns the
log-sum-exp of every row so that branches can be merged by their softmax denominators; the
backward takes the *merged* output and log-sum-exp (see ``[Note: merged backward]`` in
``attention/function.py``). Fused kernels, which never build an ``M x M`` score matrix in memory:
- CPU: torch's flash kernel, every floating dtype.
- CUDA: torch's flash kernel for float16/bfloat16 (compute capability 8.0 or newer), its
  memory-efficient kernel for float32; head sizes that are multiples of 8 up to 256 (248 with
  ignored keys: see ``[Note: masks on the fused CUDA kernels]``).
Everything else (float64 on a GPU, other head sizes, other devices) runs a plain math kernel over
the (short) compressed segments, in float64 for float64 inputs.

``key_mask`` is ``(N, H, M)`` bool, True marking a key that must be ignored. Rows that see no
key at all return ``out = 0`` and ``lse = -inf``.
"""
from __future__ import annotations

import math

import torch

_NEG_INF = float("-inf")


def _additive_mask(key_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if key_mask is None:
        return None
    mask = torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device)
    return mask.masked_fill_(key_mask, _NEG_INF).unsqueeze(2)  # (N, H, 1, M)


def rows_without_keys(key_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor | None:
    """``(N, H, M)`` bool: rows for which every key they may see is masked (None: no such rows)."""
    if key_mask is None:
        return None
    present = (~key_mask).to(torch.int32)
    if is_causal:
        return present.cumsum(-1) == 0
    return (present.sum(-1, keepdim=True) == 0).expand_as(key_mask)


def _use_cpu_flash(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64,
                                                  torch.bfloat16, torch.float16)


# [Note: masks on the fused CUDA kernels]
# torch's CUDA flash kernel takes no mask, and its memory-efficient kernel's backward, given an
# additive bias, gave wrong gradients for float16/bfloat16 on an H100 (torch 2.11; errors of 1-4
# against 1e-2 expected; float32 gave NaNs at random, maybe from the log-sum-exp layout, which is
# now padded as the kernel wants). So neither gets a bias: ignored keys are lowered through 8
# appended channels instead. Every query gets c in the first new channel, every ignored key -c,
# every other key 0 (the rest are zeros): an ignored key's score falls by scale * c^2 =
# _MASK_DROP, where exp(-_MASK_DROP) is exactly 0 in float32, and every other score is unchanged
# exactly. Rows that see no key are set right afterwards (`_fix_rows_without_keys`).
_MASK_DROP = 1e4
_CHANNELS = 8  # the kernels take head sizes in multiples of 8


def cuda_kernel(q: torch.Tensor, key_mask: torch.Tensor | None, scale: float) -> str | None:
    """The fused CUDA kernel for these inputs: ``"flash"`` (float16/bfloat16, compute
    capability 8.0+), ``"efficient"`` (float32), or None (the math kernel)."""
    if q.device.type != "cuda" or 0 in q.shape or q.shape[-1] % 8:
        return None
    head_dim = q.shape[-1] + (0 if key_mask is None else _CHANNELS)
    if head_dim > 256:
        return None
    if key_mask is not None and math.sqrt(_MASK_DROP / scale) > torch.finfo(q.dtype).max:
        return None  # c would not fit the dtype: a tiny scale in float16
    if q.dtype in (torch.float16, torch.bfloat16):
        return "flash" if torch.cuda.get_device_capability(q.device) >= (8, 0) else None
    return "efficient" if q.dtype == torch.float32 else None


def _channels(t: torch.Tensor, first: torch.Tensor | float | None) -> torch.Tensor:
    """``t`` with 8 channels appended: zeros, except ``first`` in the first (if given)."""
    extra = t.new_zeros(*t.shape[:-1], _CHANNELS)
    if first is not None:
        extra[..., 0] = first
    return torch.cat([t, extra], dim=-1)


def _masked_inputs(q, k, v, key_mask, scale):
    """Inputs for a fused CUDA kernel, ignored keys lowered by ``_MASK_DROP`` (see the note)."""
    if key_mask is None:
        return q, k, v
    c = math.sqrt(_MASK_DROP / scale)
    return (_channels(q, c), _channels(k, key_mask.to(k.dtype) * -c), _channels(v, None))


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels read strided views (no copy) as long as the last dimension is dense."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _cuda_forward(kind, q, k, v, is_causal, key_mask, scale):
    head_dim = q.shape[-1]
    q, k, v = (_unit_stride(t) for t in _masked_inputs(q, k, v, key_mask, scale))
    if kind == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, is_causal, scale=scale)[:2]
        lse = lse[..., :q.shape[-2]]  # its rows are padded to a multiple of 32
    return out[..., :head_dim], lse


#: Most segments one fused CUDA kernel call takes: both kernels put dimension 0 on a grid axis of
#: at most 65,535 blocks, and a call over more fails ("CUDA error: invalid argument"). Many short
#: segments reach it: 65,536 segments of 8 are 512k tokens, at rate 1 in one branch.
CUDA_MAX_SEGMENTS = 65535


def _in_batches(run, tensors, key_mask):
    """``run(*tensors, key_mask)`` over slices of at most CUDA_MAX_SEGMENTS of dimension 0,
    each output concatenated along it: each segment's numbers are those of one call."""
    count = tensors[0].shape[0]
    if count <= CUDA_MAX_SEGMENTS:
        return run(*tensors, key_mask)
    parts = [run(*(t[lo:lo + CUDA_MAX_SEGMENTS] for t in tensors),
                 None if key_mask is None else key_mask[lo:lo + CUDA_MAX_SEGMENTS])
             for lo in range(0, count, CUDA_MAX_SEGMENTS)]
    return tuple(torch.cat(outputs) for outputs in zip(*parts))


def _cuda_backward(kind, grad_out, q, k, v, out, lse, is_causal, key_mask, scale):
    # Without dropout the kernels read neither the sequence offsets nor the RNG state: None.
    head_dim, rows, cols = q.shape[-1], q.shape[-2], k.shape[-2]
    q, k, v = (_unit_stride(t) for t in _masked_inputs(q, k, v, key_mask, scale))
    if key_mask is not None:
        out, grad_out = _channels(out, None), _channels(grad_out, None)
    out, grad_out = _unit_stride(out), _unit_stride(grad_out)
    if kind == "flash":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse.to(torch.float32).contiguous(), None, None, rows, cols,
            0.0, is_causal, None, None, scale=scale)
    else:
        # The kernel reads lse in blocks of 32 rows, as its forward lays it out.
        padded = lse.new_full((*lse.shape[:-1], -(-rows // 32) * 32), float("inf"),
                              dtype=torch.float32)
        padded[..., :rows] = lse
        grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, None, out, padded, None, None, 0.0, [True, True, True, False],
            is_causal, scale=scale)[:3]
    return tuple(g[..., :head_dim] for g in grads)


def _fix_rows_without_keys(out, lse, key_mask, is_causal):
    """A row with no key: the CPU kernel reports ``lse = 0``, the CUDA kernels an average over
    the lowered keys; the definition says ``out = 0``, ``lse = -inf``."""
    empty = rows_without_keys(key_mask, is_causal)
    if empty is None:
        return out, lse
    return out.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, _NEG_INF)


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (exact on every device); everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _masked_scores(q, k, is_causal, key_mask, scale):
    """``scale * q k^T`` in fp32 (fp64 for fp64 inputs) with masked and (if causal) future keys
    at -inf: (N, H, M, M)."""
    acc = accumulate_dtype(q.dtype)
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    if key_mask is not None:
        scores = scores.masked_fill(key_mask[:, :, None, :], _NEG_INF)
    if is_causal:
        m = q.shape[-2]
        upper = torch.ones(m, m, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(upper, _NEG_INF)
    return scores


def _math_forward(q, k, v, is_causal, key_mask, scale):
    scores = _masked_scores(q, k, is_causal, key_mask, scale)  # (N, H, M, M)
    lse = torch.logsumexp(scores, dim=-1)  # (N, H, M)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (probs @ v.to(probs.dtype)).to(q.dtype), lse


def segment_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                              is_causal: bool, key_mask: torch.Tensor | None,
                              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over each compressed segment. Returns ``out (N, H, M, D)``, ``lse (N, H, M)`` fp32+."""
    kind = cuda_kernel(q, key_mask, scale)
    if kind is not None:
        out, lse = _in_batches(lambda q, k, v, mask: _cuda_forward(kind, q, k, v, is_causal, mask,
                                                                    scale), (q, k, v), key_mask)
        return _fix_rows_without_keys(out, lse, key_mask, is_causal)
    if not _use_cpu_flash(q):
        return _math_forward(q, k, v, is_causal, key_mask, scale)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=_additive_mask(key_mask, q.dtype), scale=scale)
    return _fix_rows_without_keys(out, lse, key_mask, is_causal)


def _math_backward(grad_out, q, k, v, out, lse, is_causal, key_mask, scale):
    acc = accumulate_dtype(q.dtype)
    qf, kf, vf, gf = q.to(acc), k.to(acc), v.to(acc), grad_out.to(acc)
    scores = _masked_scores(q, k, is_causal, key_mask, scale)  # (N, H, M, M)
    probs = torch.exp(scores - lse.to(acc).unsqueeze(-1))
    delta = (gf * out.to(acc)).sum(-1, keepdim=True)  # (N, H, M, 1)
    dscores = probs * (gf @ vf.transpose(-1, -2) - delta) * scale
    dq, dk, dv = dscores @ kf, dscores.transpose(-1, -2) @ qf, probs.transpose(-1, -2) @ gf
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def segment_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                               v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *,
                               is_causal: bool, key_mask: torch.Tensor | None,
                               scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one segment batch given the merged ``out`` and ``lse`` of its rows.

    A row with ``lse = +inf`` contributes nothing (its probabilities are all zero).
    """
    kind = cuda_kernel(q, key_mask, scale)
    if kind is not None:
        return _in_batches(lambda g, q, k, v, o, lse, mask: _cuda_backward(
            kind, g, q, k, v, o, lse, is_causal, mask, scale), (grad_out, q, k, v, out, lse), key_mask)
    if not _use_cpu_flash(q):
        return _math_backward(grad_out, q, k, v, out, lse, is_causal, key_mask, scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, is_causal,
        attn_mask=_additive_mask(key_mask, q.dtype), scale=scale)
