"""Attention dropout acts on the merged probabilities: one keep/drop decision per (batch, head,
query, key) pair, shared by every branch that covers the pair, scaled by 1 / (1 - p)."""
from __future__ import annotations

import math

import pytest
import torch

from attention import DilatedAttention, dense_dilated_attention
from attention.pair_dropout import draw_seed
from attention.reference import branch_counts, dense_keep_mask
from attention_helpers import max_error, outputs_and_grads, random_qkv

TOL64 = 1e-10

GRID = [
    # segments, rates, heads, seq
    ((4, 8), (1, 2), 4, 16),
    ((4, 8), (1, 2), 4, 13),          # ragged last segment
    ((3, 6, 12), (1, 2, 4), 3, 17),   # heads not divisible by rate
    ((8, 16, 32), (1, 2, 4), 5, 20),  # segments longer than the sequence
    ((2, 4, 8), (2, 4, 8), 8, 24),    # every branch dilated
]


@pytest.mark.parametrize("segments,rates,heads,seq", GRID)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_equals_dense_reference_with_the_same_mask(segments, rates, heads, seq, causal, padded):
    """Output and gradients equal dense attention whose merged probabilities are dropped with
    the same (B, H, T, T) mask: float64, 1e-10."""
    p, batch = 0.3, 2
    q, k, v = random_qkv(batch, seq, heads, 4, seed=seq)
    gen = torch.Generator().manual_seed(heads)
    mask = (torch.rand(batch, seq, generator=gen) < 0.3) if padded else None
    grad_out = torch.randn(batch, seq, heads, 4, dtype=torch.float64, generator=gen)
    module = DilatedAttention(segments, rates, attention_dropout=p).train()
    torch.manual_seed(11)
    keep = dense_keep_mask(draw_seed(None, q.device), batch, heads, seq, p)
    torch.manual_seed(11)  # the module draws the same seed from the global generator
    out, grads = outputs_and_grads(
        lambda *t: module(*t, is_causal=causal, key_padding_mask=mask), (q, k, v), grad_out)
    ref, ref_grads = outputs_and_grads(
        lambda *t: dense_dilated_attention(*t, segments, rates, is_causal=causal,
                                           key_padding_mask=mask, dropout_keep=keep, dropout=p),
        (q, k, v), grad_out)
    assert max_error(out, ref) < TOL64
    assert max_error(grads, ref_grads) < TOL64
    assert not keep.all() and keep.any()  # the mask drops some pairs and keeps others


def _pair_factors(module, q, k, seq, heads):
    """(draws, B, H, T, T) dropped / undropped merged probability of every pair (NaN where the
    pair has no probability), read off with one-hot values: out[b, i, h] = row i of the matrix."""
    value = torch.eye(seq, dtype=torch.float64).view(1, seq, 1, seq).expand(q.shape[0], -1, heads,
                                                                             -1)
    merged = module.eval()(q, k, value).permute(0, 2, 1, 3)  # (B, H, T, T)
    module.train()
    draws = torch.stack([module(q, k, value).permute(0, 2, 1, 3) for _ in range(200)])
    return torch.where(merged > 1e-12, draws / merged, float("nan"))


@pytest.mark.parametrize("segments,rates,heads,seq", [((4, 8), (1, 2), 2, 16),
                                                      ((3, 6, 12), (1, 2, 4), 3, 17)])
def test_every_pair_is_scaled_by_zero_or_one_over_keep(segments, rates, heads, seq):
    """Dropping each branch independently scaled a pair two branches cover (e.g. query 0, key 2
    of head 0 for segments (4, 8), rates (1, 2)) by 0, 1 or 2 at p = 0.5; dense dropout on the
    merged probabilities scales it by 0 or 2 only, and keeps it half the time."""
    p = 0.5
    torch.manual_seed(0)
    q, k, _ = random_qkv(2, seq, heads, seq)  # head_dim = seq: the values are one-hot rows
    module = DilatedAttention(segments, rates, attention_dropout=p)
    with torch.no_grad():
        factors = _pair_factors(module, q, k, seq, heads)
    present = ~factors.isnan()
    values = factors[present]
    dropped, kept = values.abs() < 1e-9, (values - 1 / (1 - p)).abs() < 1e-9
    assert bool((dropped | kept).all()), sorted(set(values[~(dropped | kept)].tolist()))[:5]
    shared = branch_counts(seq, segments, rates, heads)[None, None] > 1  # (1, 1, H, T, T)
    shared_kept = kept.new_zeros(factors.shape)
    shared_kept[present] = kept
    shared_pairs = (shared & present).sum().item()
    assert shared_pairs > 100  # pairs covered by two or more branches take part
    rate, sigma = (shared_kept & shared).sum().item() / shared_pairs, math.sqrt(p * (1 - p) / shared_pairs)
    assert abs(rate - (1 - p)) < 5 * sigma
    if segments == (4, 8):
        pair = factors[:, 0, 0, 0, 2]  # query 0, key 2, head 0: both branches cover it
        assert set(pair.round(decimals=9).tolist()) == {0.0, 2.0}


def test_decisions_are_independent_bernoulli():
    """Over 0.5M pairs of one seed: the keep rate is 1 - p, and a pair's neighbours along the
    key, the query, the head and the batch are kept independently of it (within 5 sigma)."""
    p = 0.3
    torch.manual_seed(3)
    keep = dense_keep_mask(draw_seed(None, torch.device("cpu")), 2, 4, 256, p).double()
    q = 1 - p
    checks = [(keep.mean(), q)]
    for neighbour in (keep[..., 1:] * keep[..., :-1], keep[..., 1:, :] * keep[..., :-1, :],
                      keep[:, 1:] * keep[:, :-1], keep[1:] * keep[:-1],
                      keep * keep.transpose(-1, -2)):
        checks.append((neighbour.mean(), q * q))
    for (observed, expected), n in zip(checks, [keep.numel()] + [keep.numel() // 2] * 5):
        assert abs(observed.item() - expected) < 5 * math.sqrt(expected * (1 - expected) / n)


def test_generator_state_fixes_the_masks():
    """Same generator state, same masks; the next draw (the next step) another."""
    q, k, v = random_qkv(1, 16, 4, 4)
    module = DilatedAttention([4, 8], [1, 2], attention_dropout=0.2).train()
    torch.manual_seed(5)
    first, second = module(q, k, v), module(q, k, v)
    torch.manual_seed(5)
    assert torch.equal(module(q, k, v), first)
    assert not torch.equal(first, second)
