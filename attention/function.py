"""The exact dilated-attention autograd function, shared by the single-device and ring modules.

Work is split into *units*: one head group of one branch (``attention/plan.py``). Each unit reads
its compressed queries from the local tensors and its keys and values through a *key source*
(a local read on one device; a read plus an exchange of dilated keys in the ring), runs the
segment kernel, and is merged into running accumulators (fp32, or fp64 for fp64 inputs) by its
log-sum-exp: an online softmax merge done in place on the rows the unit covers.

[Note: merged backward]
The merged output equals ``softmax(S + log C) V`` over the union of branches. Its gradient with
respect to branch i's scores is ``P_i' * (dO V^T - rowsum(dO * O))`` where
``P_i' = exp(S_i - LSE)`` uses the *merged* log-sum-exp and ``O`` is the *merged* output. That is
exactly what a flash-attention backward computes when it is handed the merged ``O`` and ``LSE``
instead of the branch's own, so each unit calls the kernel backward with them and the gradients
are summed. No merge weight is detached: the result equals autograd through the dense formula.
Rows a unit must not touch (padding rows, rows outside this rank's slice, rows that see no key at
all) get ``LSE = +inf`` so that their probabilities are zero.

[Note: double backward]
The kernels' backward is not itself differentiable. A backward with ``create_graph=True`` (a
gradient penalty, a Hessian-vector product) therefore computes the gradients again as autograd
ops over the same units (``attention/autograd_path.py``, O(seq * w / r) memory per branch), from
the saved inputs as the caller passed them (contiguous copies made in forward would have no
history), through one alias per role (a tensor passed as q, k and v then gets each role's
gradient once, not the sum of all three per role), so the gradient of the gradient is exact. Before,
``once_differentiable`` was meant to refuse it, but it refuses only when the incoming gradient
requires grad: with a constant one (``out.sum()``) the penalty's dependence on q, k and v was
dropped without a word. The ring's key exchange has no such form: it raises.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from attention.kernel import accumulate_dtype, segment_attention_backward, segment_attention_forward
from attention.plan import SlotPlan


class KeySource(Protocol):
    """Supplies one unit's compressed keys and values and takes back their gradients."""

    plan: SlotPlan

    def gather_keys(self, key: torch.Tensor, value: torch.Tensor,
                    key_padding_mask: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(B*nseg, hg, M, D)`` keys and values and the ``(B*nseg, hg, M)`` ignored-key mask."""
        ...

    def return_key_grads(self, grad_key_c: torch.Tensor, grad_value_c: torch.Tensor,
                         grad_key: torch.Tensor, grad_value: torch.Tensor) -> None:
        """Add the compressed gradients into the local ``(B, T_local, H, D)`` gradients."""
        ...


def tile_batch(mask: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """``(nseg, hg, M) -> (B * nseg, hg, M)``."""
    if mask is None:
        return None
    return mask.unsqueeze(0).expand(batch, -1, -1, -1).reshape(-1, *mask.shape[1:])


def compressed_key_mask(key_padding_mask: torch.Tensor | None, plan: SlotPlan,
                        missing: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """``(B*nseg, hg, M)`` bool of keys to ignore: padded keys and slots beyond the sequence."""
    mask = None
    if key_padding_mask is not None:
        expanded = key_padding_mask[:, :, None, None].expand(-1, -1, plan.num_heads, 1)
        mask = plan.compressed(expanded.contiguous()).squeeze(-1)  # (B*nseg, hg, M)
    missing = tile_batch(missing, batch)
    if missing is not None:
        mask = missing if mask is None else (mask | missing)
    return mask


def first_branch_units(sources: Sequence[KeySource]) -> int:
    """How many leading units belong to the first branch. Each reads one head group of it, so no
    two cover the same rows: each is the first to write its rows (see ``_combine_rows``)."""
    first = sources[0].plan if sources else None
    count, previous = 0, -1
    for source in sources:
        plan = source.plan
        if ((plan.segment_length, plan.dilation_rate) != (first.segment_length, first.dilation_rate)
                or plan.head_start <= previous):  # another branch (one alike restarts at head 0)
            break
        count, previous = count + 1, plan.head_start
    return count


#: Largest kernel output (bytes) that one call makes for a unit whose segments can be taken in
#: parts: above it the unit runs in parts of its segments ([Note: units in parts]).
PART_BYTES = 8 << 20


def unit_parts(source: KeySource, qc: torch.Tensor) -> list[slice] | None:
    """The segment ranges (of ``qc``'s first dimension, ``B * nseg``) one unit runs in, or None
    where it runs whole: a plan that is not regular (its rows are gathered) or keys from other
    ranks. [Note: units in parts]: segments are independent, so a unit whose kernel output would
    exceed PART_BYTES runs in parts of at most that size, each merged into the accumulators
    (backward: its gradients added) through views of them, so that its transient memory is one
    part's, not the unit's. The numbers are those of one call: each element is computed alike."""
    if not source.plan.regular or getattr(source, "exchanges", False):
        return None
    count = qc.shape[0]
    per_part = max(1, PART_BYTES // max(1, qc[:1].numel() * qc.element_size()))
    return [slice(lo, min(lo + per_part, count)) for lo in range(0, count, per_part)]


def _combine_rows(old_out, old_lse, out_i, lse_i, first: bool) -> None:
    """Rows of a unit into the accumulators' rows ``old_out``/``old_lse`` (views of them, or
    copies the caller writes back), in place: an online softmax merge by log-sum-exp, or, for the
    first unit to reach them, a copy (the merge against ``lse = -inf`` gives it exactly, through
    three temporaries of its size)."""
    if first:
        old_out.copy_(out_i)
        old_lse.copy_(lse_i)
        return
    lse_i = lse_i.to(old_lse.dtype)
    new_lse = torch.logaddexp(old_lse, lse_i)
    safe = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    old_out.mul_(torch.exp(old_lse - safe)).add_(out_i * torch.exp(lse_i - safe))  # out_i promoted
    old_lse.copy_(new_lse)


def forward_units(query, key, value, key_padding_mask, sources: Sequence[KeySource],
                  is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` over all units: ``(B, T, H, D)`` in the query's dtype, ``(B, T, H)`` in the
    accumulation dtype (``-inf`` on rows no key reaches), without autograd."""
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    acc_dtype = accumulate_dtype(query.dtype)
    batch, local_len, heads, head_dim = query.shape
    acc_out = query.new_zeros(batch, local_len, heads, head_dim, dtype=acc_dtype)
    acc_lse = query.new_full((batch, local_len, heads, 1), float("-inf"), dtype=acc_dtype)
    writes = first_branch_units(sources)
    for index, source in enumerate(sources):
        plan, first = source.plan, index < writes
        qc = plan.compressed(query)  # (B*nseg, hg, M, D)
        kc, vc, key_mask = source.gather_keys(key, value, key_padding_mask)
        parts = unit_parts(source, qc)
        if parts is None:  # rows gathered: merged into copies that are written back
            out_c, lse_c = segment_attention_forward(qc, kc, vc, is_causal=is_causal,
                                                     key_mask=key_mask, scale=scale)
            out_i, lse_i = plan.valid(out_c, batch), plan.valid(lse_c.unsqueeze(-1), batch)
            if not first:
                rows_out, rows_lse = plan.local(acc_out), plan.local(acc_lse)  # copies
                _combine_rows(rows_out, rows_lse, out_i, lse_i, first=False)
                out_i, lse_i = rows_out, rows_lse
            plan.write_local(acc_out, out_i)
            plan.write_local(acc_lse, lse_i)
            continue
        rows_out, rows_lse = plan.segments(acc_out), plan.segments(acc_lse)  # views
        for part in parts:
            out_c, lse_c = segment_attention_forward(
                qc[part], kc[part], vc[part], is_causal=is_causal,
                key_mask=None if key_mask is None else key_mask[part], scale=scale)
            _combine_rows(rows_out[part], rows_lse[part], out_c, lse_c.unsqueeze(-1), first)
            del out_c, lse_c
    return acc_out.to(query.dtype), acc_lse.squeeze(-1)


def backward_units(grad_out, query, key, value, key_padding_mask, out, lse,
                   sources: Sequence[KeySource], is_causal: bool, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k and v (in their dtypes) from forward_units' ``out`` and ``lse``, by
    the kernels' backward over the same units ([Note: merged backward]); not differentiable."""
    grads = [torch.zeros(t.shape, dtype=lse.dtype, device=t.device) for t in (query, key, value)]
    # Rows no unit covers, or that see no key, must contribute nothing: +inf.
    lse_bwd = lse.unsqueeze(-1).masked_fill(torch.isneginf(lse).unsqueeze(-1), float("inf"))
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    grad_out = grad_out.to(query.dtype).contiguous()
    for source in sources:
        _unit_backward(query, key, value, out, lse_bwd, grad_out, key_padding_mask, source,
                       is_causal, scale, grads)
    dq, dk, dv = (g.to(t.dtype) for g, t in zip(grads, (query, key, value)))
    return dq, dk, dv


class DilatedAttentionFunction(torch.autograd.Function):
    """``(q, k, v) -> (out, lse)`` over all units, exact forward and backward (no dropout)."""

    @staticmethod
    def forward(ctx, query, key, value, key_padding_mask, sources: Sequence[KeySource],
                is_causal: bool, scale: float):
        out, lse = forward_units(query, key, value, key_padding_mask, sources, is_causal, scale)
        # The inputs as given are saved: backward(create_graph=True) differentiates through them,
        # and copies made here (without grad) would carry no graph ([Note: double backward]).
        ctx.save_for_backward(query, key, value, out, lse, key_padding_mask)
        ctx.sources, ctx.is_causal, ctx.scale = sources, is_causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        query, key, value, out, lse, key_padding_mask = ctx.saved_tensors
        if torch.is_grad_enabled():  # backward(create_graph=True): see [Note: double backward]
            return _differentiable_backward(ctx, query, key, value, key_padding_mask, grad_out)
        grads = backward_units(grad_out, query, key, value, key_padding_mask, out, lse, ctx.sources,
                               ctx.is_causal, ctx.scale)
        return (*grads, None, None, None, None)


def _unit_backward(q, k, v, out, lse, grad_out, key_padding_mask, source, is_causal, scale,
                   grads):
    plan = source.plan
    batch = q.shape[0]
    qc = plan.compressed(q)
    kc, vc, key_mask = source.gather_keys(k, v, key_padding_mask)
    lse_c = plan.compressed(lse).squeeze(-1)  # (B*nseg, hg, M)
    grad_out_c, out_c = plan.compressed(grad_out), plan.compressed(out)
    parts = unit_parts(source, qc)
    if parts is not None:  # [Note: units in parts]; keys local: their gradients land in views too
        for part in parts:
            found = list(segment_attention_backward(
                grad_out_c[part], qc[part], kc[part], vc[part], out_c[part], lse_c[part].contiguous(),
                is_causal=is_causal, key_mask=None if key_mask is None else key_mask[part], scale=scale))
            while found:  # each part's gradients freed before the next part's are made
                plan.segments(grads[len(found) - 1])[part].add_(found.pop())
        return
    outside = tile_batch(plan.outside_rows, batch)
    if outside is not None:
        lse_c = lse_c.masked_fill(outside, float("inf"))
    dqc, dkc, dvc = segment_attention_backward(
        grad_out_c, qc, kc, vc, out_c, lse_c.contiguous(), is_causal=is_causal, key_mask=key_mask,
        scale=scale)
    plan.add_local(grads[0], plan.valid(dqc, batch))
    source.return_key_grads(dkc, dvc, grads[1], grads[2])


def _differentiable_backward(ctx, query, key, value, key_padding_mask, grad_out):
    """The gradients as differentiable torch ops: autograd through the same units and merge
    (``attention/autograd_path.py``, without dropout), so a gradient of them is exact."""
    if any(getattr(source, "exchanges", False) for source in ctx.sources):
        raise RuntimeError(
            "RingDilatedAttention's backward cannot be differentiated (backward with "
            "create_graph=True, as for a gradient penalty): its key exchange between ranks has no "
            "gradient of its own; compute the penalty with DilatedAttention on one device")
    from attention.autograd_path import dilated_attention_autograd  # (it imports this module)
    # One alias per role, joined to the saved input's graph: with a tensor in several roles (self-
    # attention's x, x, x), the gradient with respect to the tensor itself would be every role's
    # sum, returned once per role and summed again by autograd.
    query, key, value = (t.view_as(t) for t in (query, key, value))
    inputs = (query, key, value)
    wanted = [t for t, needed in zip(inputs, ctx.needs_input_grad) if needed]
    out = dilated_attention_autograd(query, key, value, ctx.sources, is_causal=ctx.is_causal,
                                     key_padding_mask=key_padding_mask, scale=ctx.scale, dropout=0.0)
    found = iter(torch.autograd.grad(out, wanted, grad_out, create_graph=True, allow_unused=True))
    grads = [next(found) if needed else None for needed in ctx.needs_input_grad[:3]]
    return (*grads, None, None, None, None)


class LocalKeySource:
    """Single device: keys and values are read from the same slice as the queries."""

    exchanges = False  # no communication: its gather is differentiable ([Note: double backward])

    def __init__(self, plan: SlotPlan, is_causal: bool) -> None:
        self.plan = plan
        self._missing = plan.missing_keys(is_causal)

    def gather_keys(self, key, value, key_padding_mask):
        plan = self.plan
        mask = compressed_key_mask(key_padding_mask, plan, self._missing, key.shape[0])
        return plan.compressed(key), plan.compressed(value), mask

    def return_key_grads(self, grad_key_c, grad_value_c, grad_key, grad_value):
        batch = grad_key.shape[0]
        self.plan.add_local(grad_key, self.plan.valid(grad_key_c, batch))
        self.plan.add_local(grad_value, self.plan.valid(grad_value_c, batch))
