"""The exact dilated-attention autograd function, shared by the single-device and ring modules.

Each branch reads compressed segments through a *key source* (local gather on one device, a
gather plus an exchange of dilated keys in the ring), runs the segment kernel, and is merged into
running fp32 accumulators by its log-sum-exp (online softmax merge).

[Note: merged backward]
The merged output equals ``softmax(S + log C) V`` over the union of branches. Its gradient with
respect to branch i's scores is ``P_i' * (dO V^T - rowsum(dO * O))`` where
``P_i' = exp(S_i - LSE)`` uses the *merged* log-sum-exp and ``O`` is the *merged* output. That is
exactly what a flash-attention backward computes when it is handed the merged ``O`` and ``LSE``
instead of the branch's own, so each branch calls the kernel backward with them and the
gradients are summed. No merge weight is detached: the result equals autograd through the dense
formula. Rows a branch must not touch (padding rows, rows outside this rank's slice, rows that
see no key at all) get ``LSE = +inf`` so that their probabilities are zero.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from attention.kernel import segment_attention_backward, segment_attention_forward
from attention.plan import BranchPlan


class KeySource(Protocol):
    """Supplies one branch's compressed keys and values and takes back their gradients."""

    plan: BranchPlan

    def gather_keys(self, key: torch.Tensor, value: torch.Tensor,
                    key_padding_mask: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(B*nseg, H, M, D)`` keys and values and the ``(B*nseg, H, M)`` mask of ignored keys."""
        ...

    def return_key_grads(self, grad_key_c: torch.Tensor, grad_value_c: torch.Tensor,
                         grad_key: torch.Tensor, grad_value: torch.Tensor) -> None:
        """Add the compressed gradients into the local ``(B, T_local, H, D)`` gradients."""
        ...


def gather_slots(x: torch.Tensor, plan: BranchPlan) -> torch.Tensor:
    """``(B, T_local, H, X) -> (B * nseg, H, M, X)`` by the plan's (clamped) gather index."""
    batch, _, heads, width = x.shape
    flat = x.reshape(batch, -1, width).index_select(1, plan.gather_index)  # (B, S, X)
    return flat.view(batch * plan.num_segments, heads, plan.rows_per_segment, width)


def scatter_local_rows(src: torch.Tensor, plan: BranchPlan, into: torch.Tensor) -> None:
    """Add the valid (local) rows of ``src (B*nseg, H, M, X)`` into ``into (B, T_local, H, X)``."""
    batch, width = into.shape[0], into.shape[-1]
    flat_src = src.reshape(batch, -1, width)  # (B, S, X)
    if plan.all_slots_local:
        targets = plan.gather_index
    else:
        slots = plan.local_slots
        targets = plan.local_targets
        flat_src = flat_src.index_select(1, slots)
    into.view(batch, -1, width).index_add_(1, targets, flat_src.to(into.dtype))


def _local_row_mask(plan: BranchPlan, batch: int, device: torch.device) -> torch.Tensor | None:
    """``(B*nseg, H, M)`` bool of rows that are not this slice's queries (None: all are)."""
    if plan.all_slots_local:
        return None
    pos = plan.slot_positions.to(device)
    outside = (pos < plan.start) | (pos >= plan.stop)
    return outside.unsqueeze(0).expand(batch, -1, -1, -1).reshape(-1, *pos.shape[1:])


def _merge(acc_out, acc_lse, out_i, lse_i):
    """Online softmax merge of one branch into the accumulators (all fp32 or fp64)."""
    new_lse = torch.logaddexp(acc_lse, lse_i)  # (B, T, H)
    safe = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    acc_out.mul_(torch.exp(acc_lse - safe).unsqueeze(-1))
    acc_out.add_(out_i * torch.exp(lse_i - safe).unsqueeze(-1))
    return acc_out, new_lse


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _branch_forward(q, k, v, key_padding_mask, source, is_causal, scale, acc_dtype):
    plan = source.plan
    batch, local_len, heads, head_dim = q.shape
    qc = gather_slots(q, plan)  # (B*nseg, H, M, D)
    kc, vc, key_mask = source.gather_keys(k, v, key_padding_mask)
    out_c, lse_c = segment_attention_forward(qc, kc, vc, is_causal=is_causal,
                                             key_mask=key_mask, scale=scale)
    out_i = q.new_zeros(batch, local_len, heads, head_dim, dtype=acc_dtype)
    lse_i = q.new_zeros(batch, local_len, heads, 1, dtype=acc_dtype)
    covered = q.new_zeros(batch, local_len, heads, 1, dtype=acc_dtype)
    scatter_local_rows(out_c, plan, out_i)
    scatter_local_rows(lse_c.unsqueeze(-1), plan, lse_i)
    scatter_local_rows(torch.ones_like(lse_c).unsqueeze(-1), plan, covered)
    lse_i = lse_i.masked_fill(covered == 0, float("-inf")).squeeze(-1)  # (B, T, H)
    return out_i, lse_i


class DilatedAttentionFunction(torch.autograd.Function):
    """``(q, k, v) -> out`` over all branches, exact forward and backward (no dropout)."""

    @staticmethod
    def forward(ctx, query, key, value, key_padding_mask, sources: Sequence[KeySource],
                is_causal: bool, scale: float):
        acc_dtype = accumulate_dtype(query.dtype)
        batch, local_len, heads, head_dim = query.shape
        acc_out = query.new_zeros(batch, local_len, heads, head_dim, dtype=acc_dtype)
        acc_lse = query.new_full((batch, local_len, heads), float("-inf"), dtype=acc_dtype)
        for source in sources:
            out_i, lse_i = _branch_forward(query, key, value, key_padding_mask, source,
                                           is_causal, scale, acc_dtype)
            acc_out, acc_lse = _merge(acc_out, acc_lse, out_i, lse_i)
        out = acc_out.to(query.dtype)  # (B, T, H, D)
        ctx.save_for_backward(query, key, value, out, acc_lse, key_padding_mask)
        ctx.sources, ctx.is_causal, ctx.scale = sources, is_causal, scale
        ctx.mark_non_differentiable(acc_lse)
        return out, acc_lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        query, key, value, out, lse, key_padding_mask = ctx.saved_tensors
        acc_dtype = lse.dtype
        grads = [torch.zeros(t.shape, dtype=acc_dtype, device=t.device)
                 for t in (query, key, value)]
        # Rows no branch covers, or that see no key, must contribute nothing: +inf.
        lse_bwd = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
        grad_out = grad_out.to(query.dtype).contiguous()
        for source in ctx.sources:
            _branch_backward(query, key, value, out, lse_bwd, grad_out, key_padding_mask,
                             source, ctx.is_causal, ctx.scale, grads)
        dq, dk, dv = (g.to(t.dtype) for g, t in zip(grads, (query, key, value)))
        return dq, dk, dv, None, None, None, None


def _branch_backward(q, k, v, out, lse, grad_out, key_padding_mask, source, is_causal, scale,
                     grads):
    plan = source.plan
    qc = gather_slots(q, plan)
    kc, vc, key_mask = source.gather_keys(k, v, key_padding_mask)
    out_c = gather_slots(out, plan)
    grad_c = gather_slots(grad_out, plan)
    lse_c = gather_slots(lse.unsqueeze(-1), plan).squeeze(-1)  # (B*nseg, H, M)
    outside = _local_row_mask(plan, q.shape[0], q.device)
    if outside is not None:
        lse_c = lse_c.masked_fill(outside, float("inf"))
    dqc, dkc, dvc = segment_attention_backward(grad_c, qc, kc, vc, out_c, lse_c.contiguous(),
                                               is_causal=is_causal, key_mask=key_mask,
                                               scale=scale)
    scatter_local_rows(dqc, plan, grads[0])
    source.return_key_grads(dkc, dvc, grads[1], grads[2])


class LocalKeySource:
    """Single device: keys and values come from the same tensors as the queries."""

    def __init__(self, plan: BranchPlan, is_causal: bool) -> None:
        self.plan = plan
        self._missing = plan.missing_keys(is_causal)

    def gather_keys(self, key, value, key_padding_mask):
        kc, vc = gather_slots(key, self.plan), gather_slots(value, self.plan)
        return kc, vc, gather_key_mask(key_padding_mask, self.plan, self._missing, key.shape[0])

    def return_key_grads(self, grad_key_c, grad_value_c, grad_key, grad_value):
        scatter_local_rows(grad_key_c, self.plan, grad_key)
        scatter_local_rows(grad_value_c, self.plan, grad_value)


def gather_key_mask(key_padding_mask: torch.Tensor | None, plan: BranchPlan,
                    missing: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """``(B*nseg, H, M)`` bool of keys to ignore: padded keys and slots beyond the sequence."""
    mask = None
    if key_padding_mask is not None:
        expanded = key_padding_mask[:, :, None, None].expand(-1, -1, plan.num_heads, 1)
        mask = gather_slots(expanded, plan).squeeze(-1)  # (B*nseg, H, M)
    if missing is not None:
        missing = missing.to(plan.slot_positions.device if mask is None else mask.device)
        tiled = missing.unsqueeze(0).expand(batch, -1, -1, -1).reshape(-1, *missing.shape[1:])
        mask = tiled if mask is None else (mask | tiled)
    return mask
