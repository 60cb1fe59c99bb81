"""RingDilatedAttention gives each rank its slice of the single-device result, fwd and bwd."""
from __future__ import annotations


import pytest
import torch

from attention import DilatedAttention, RingDilatedAttention
from distframe.launch import spawn

CASES = [
    # world, segments, rates, seq, heads, causal, padded
    (2, (4, 8), (1, 2), 16, 4, False, False),   # aligned: no communication
    (2, (8, 16), (1, 2), 24, 4, True, True),
    (3, (4, 8, 16), (1, 2, 4), 18, 5, True, True),
    (3, (24,), (2,), 24, 4, False, False),       # one global segment
    (4, (4, 8, 16), (1, 2, 4), 24, 4, False, True),
    (4, (6, 12), (1, 3), 24, 3, True, False),
]


def _single_device(world, segments, rates, seq, heads, causal, padded, dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, seq, heads, 4, dtype=dtype, generator=gen).requires_grad_()
               for _ in range(3))
    grad_out = torch.randn(2, seq, heads, 4, dtype=dtype, generator=gen)
    mask = (torch.rand(2, seq, generator=gen) < 0.3) if padded else None
    out = DilatedAttention(segments, rates)(q, k, v, is_causal=causal, key_padding_mask=mask)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    return (q, k, v, grad_out, mask), out, grads


class RingRank:
    """Picklable per-rank body (gloo runs it in spawned processes)."""

    def __init__(self, case, inputs):
        self.case, self.inputs = case, inputs

    def __call__(self, backend):
        _, segments, rates, seq, _, causal, _ = self.case
        q, k, v, grad_out, mask = self.inputs
        local = seq // backend.world_size
        part = slice(backend.rank * local, (backend.rank + 1) * local)
        mine = [t.detach()[:, part].clone().requires_grad_() for t in (q, k, v)]
        module = RingDilatedAttention(segments, rates, backend=backend)
        out = module(*mine, is_causal=causal,
                     key_padding_mask=None if mask is None else mask[:, part])
        grads = torch.autograd.grad(out, mine, grad_out[:, part])
        return out.detach(), [g.detach() for g in grads], backend.stats.bytes["all_to_all"]


def _check(case, engine, dtype, tol):
    (q, k, v, grad_out, mask), ref, ref_grads = _single_device(*case, dtype)
    results = spawn(RingRank(case, (q.detach(), k.detach(), v.detach(), grad_out, mask)),
                    case[0], backend=engine)
    out = torch.cat([r[0] for r in results], dim=1)
    assert (out - ref).abs().max().item() < tol
    for i, ref_grad in enumerate(ref_grads):
        grad = torch.cat([r[1][i] for r in results], dim=1)
        assert (grad - ref_grad).abs().max().item() < tol
    return [r[2] for r in results]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_ring_equals_single_device_inmemory(case, dtype, tol):
    sent = _check(case, "inmemory", dtype, tol)
    if case[0] == 2 and case[3] == 16:
        assert sent == [0, 0]  # every segment inside a slice: nothing moves
    else:
        assert sum(sent) > 0


def test_ring_moves_only_dilated_keys():
    """A global segment with rate 4 moves about a quarter of what gathering k and v would."""
    case = (4, (32,), (4,), 32, 4, False, False)
    sent = _check(case, "inmemory", torch.float64, 1e-10)
    kv_bytes_per_rank = 2 * 2 * 8 * 4 * 4 * 8  # k, v of the local slice: (2, 8, 4, 4) float64
    full_gather = 3 * kv_bytes_per_rank  # what an all-gather of the other ranks' k, v costs
    # forward exchange + backward exchange + gradient return, each a quarter of the gather
    assert max(sent) <= 3 * full_gather / 4 + 1


@pytest.mark.gloo
def test_ring_equals_single_device_gloo():
    _check((2, (8, 16), (1, 2), 24, 4, True, True), "gloo", torch.float64, 1e-10)


class HeadSliceRingRank(RingRank):
    """Each rank holds heads [lo, hi) of its slice: a tensor-parallel rank inside a cp ring."""

    def __init__(self, case, inputs, heads):
        super().__init__(case, inputs)
        self.heads = heads

    def __call__(self, backend):
        _, segments, rates, seq, total, causal, _ = self.case
        q, k, v, grad_out, mask = self.inputs
        (lo, hi), local = self.heads, seq // backend.world_size
        part = slice(backend.rank * local, (backend.rank + 1) * local)
        mine = [t.detach()[:, part, lo:hi].clone().requires_grad_() for t in (q, k, v)]
        module = RingDilatedAttention(segments, rates, backend=backend, head_start=lo, total_heads=total)
        out = module(*mine, is_causal=causal, key_padding_mask=None if mask is None else mask[:, part])
        grads = torch.autograd.grad(out, mine, grad_out[:, part, lo:hi])
        return out.detach(), [g.detach() for g in grads]


@pytest.mark.parametrize("case,heads", [
    ((2, (8, 16), (1, 2), 24, 4, True, True), [(0, 2), (2, 4), (1, 3)]),  # rate 1: 4-head group split
    ((3, (4, 8, 16), (1, 2, 4), 18, 5, True, True), [(0, 3), (3, 5), (2, 3)]),  # odd heads and world
    ((4, (6, 12), (1, 3), 24, 3, False, False), [(0, 1), (1, 3)]),
])
def test_ring_over_a_slice_of_the_heads(case, heads):
    """Heads [lo, hi) of a head-split model read what those heads read in the dense module
    (offsets of the global head index), forward and backward, float64 1e-10."""
    (q, k, v, grad_out, mask), ref, ref_grads = _single_device(*case, torch.float64)
    inputs = (q.detach(), k.detach(), v.detach(), grad_out, mask)
    for lo, hi in heads:
        results = spawn(HeadSliceRingRank(case, inputs, (lo, hi)), case[0])
        out = torch.cat([r[0] for r in results], dim=1)
        assert (out - ref[:, :, lo:hi]).abs().max().item() < 1e-10, (lo, hi)
        for i, ref_grad in enumerate(ref_grads):
            grad = torch.cat([r[1][i] for r in results], dim=1)
            assert (grad - ref_grad[:, :, lo:hi]).abs().max().item() < 1e-10, (lo, hi, i)


def test_head_slice_outside_the_heads_is_an_error():
    with pytest.raises(ValueError, match="head_start"):
        RingDilatedAttention((4,), (1,), backend=None, head_start=4, total_heads=4)
    # Without total_heads a head_start would be ignored: heads 0.. would be read silently.
    with pytest.raises(ValueError, match="head_start=2 needs total_heads"):
        RingDilatedAttention((4,), (2,), backend=None, head_start=2)

    def run(backend):
        module = RingDilatedAttention((4,), (1,), backend=backend, head_start=2, total_heads=4)
        x = torch.zeros(1, 4, 3, 2)  # three heads from head 2 of 4
        module(x, x, x)

    with pytest.raises(ValueError, match=r"heads \[2, 5\) do not fit in num_heads=4"):
        spawn(run, 2)


def test_slices_of_different_lengths_are_an_error():
    """``torch.chunk`` of 11 positions over 4 ranks gives 3, 3, 3, 2: each rank would place its
    slice at ``rank * its own length`` and (here) return a wrong result without a word."""
    x = torch.randn(1, 11, 2, 4, dtype=torch.float64)

    def run(backend):
        mine = torch.chunk(x, backend.world_size, dim=1)[backend.rank]
        RingDilatedAttention((6,), (3,), backend=backend)(mine, mine, mine, is_causal=True)

    with pytest.raises(ValueError, match=r"slices of one length.*\[3, 3, 3, 2\]"):
        spawn(run, 4)


def test_dropout_set_after_construction_is_refused_in_training():
    """The constructor refuses ``attention_dropout``; set on the module later (a fine-tuning loop
    that turns dropout on in every DilatedAttention), the dropout path's key gather was not
    differentiable across ranks: keys and values held elsewhere got no gradient (1.8 off, no
    error). Training refuses it; eval mode (no dropout) still runs."""
    x = torch.randn(1, 16, 1, 4, dtype=torch.float64)

    def run(backend):
        module = RingDilatedAttention((16,), (1,), backend=backend)
        module.attention_dropout = 0.1
        mine = x.chunk(backend.world_size, dim=1)[backend.rank]
        with pytest.raises(ValueError, match="attention_dropout"):
            module(mine, mine, mine)
        module.eval()
        return module(mine, mine, mine)

    out = torch.cat(spawn(run, 2), dim=1)
    torch.testing.assert_close(out, DilatedAttention((16,), (1,))(x, x, x), rtol=1e-10, atol=1e-10)
