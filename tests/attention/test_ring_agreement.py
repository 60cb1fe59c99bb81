"""RingDilatedAttention checks on every forward that the ranks' calls agree (slice length,
batch, heads, is_causal, mask given or not, branches and scale): every rank derives every route
from its own call and module, so a disagreement must be an error that names it, not mismatched
collectives or a wrong result."""
from __future__ import annotations

import pytest
import torch

from attention import RingDilatedAttention
from distframe.launch import spawn

SEQ = torch.randn(1, 12, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


class EqualThenRaggedSlices:
    """A batch of 12 positions, then the last, shorter batch of 11 cut by ``torch.chunk``
    (slices 3, 3, 3, 2 over 4 ranks): ranks 0-2 have seen their slice length before, rank 3 not.
    Picklable: Gloo runs it in spawned processes."""

    def __init__(self, segments, rates):
        self.segments, self.rates = segments, rates

    def __call__(self, backend):
        module = RingDilatedAttention(self.segments, self.rates, backend=backend)
        for length in (12, 11):
            mine = torch.chunk(SEQ[:, :length], backend.world_size, dim=1)[backend.rank]
            module(mine, mine, mine, is_causal=True)


@pytest.mark.parametrize("segments,rates", [
    ((3,), (3,)),  # segments inside every slice: the ranks that knew the length did not communicate
    ((12,), (3,)),  # a global segment: they went on to the key exchange
])
def test_ragged_slices_after_equal_ones_are_an_error(segments, rates):
    """The slice lengths were checked only when a rank met a new one: here rank 3 alone did, so
    its all_gather met the others' all_to_all (in memory: CollectiveMismatchError about
    collectives; Gloo aborted the processes). Now every rank checks on every forward."""
    with pytest.raises(ValueError, match=r"slices of one length.*\[3, 3, 3, 2\]"):
        spawn(EqualThenRaggedSlices(segments, rates), 4)


@pytest.mark.gloo
def test_ragged_slices_after_equal_ones_are_an_error_on_gloo():
    with pytest.raises(ValueError, match=r"slices of one length.*\[6, 5\]"):
        spawn(EqualThenRaggedSlices((12,), (3,)), 2, backend="gloo")


@pytest.mark.parametrize("differs", ["is_causal", "mask", "batch", "dtype"])
def test_ranks_that_disagree_on_the_call_are_an_error_naming_it(differs):
    """Routes, payload widths and chunk sizes follow from the call: a rank with another
    is_causal, without the mask the others pass, or with another batch would exchange the
    wrong rows or fail inside the backend; one with another dtype exchanges payloads of another
    size (in memory a CollectiveMismatchError about all_to_all, on Gloo an abort)."""
    def run(backend):
        odd = backend.rank == 1
        module = RingDilatedAttention((12,), (3,), backend=backend)
        batch = 2 if differs == "batch" and odd else 1
        mine = SEQ[:, 6 * backend.rank:6 * (backend.rank + 1)].expand(batch, -1, -1, -1)
        if differs == "dtype" and odd:
            mine = mine.float()
        mask = torch.zeros(batch, 6, dtype=torch.bool)
        module(mine, mine, mine, is_causal=differs == "is_causal" and odd,
               key_padding_mask=None if differs == "mask" and odd else mask)

    with pytest.raises(ValueError, match=r"same batch, heads, head_dim and dtype, the same is_causal.*"
                                         r"rank 1: \(batch, heads, head_dim\) = \((1|2), 2, 4\), "
                                         r"(float32|float64)"):
        spawn(run, 2)


def test_the_check_is_one_small_all_gather_per_forward():
    def run(backend):
        module = RingDilatedAttention((3,), (3,), backend=backend)
        mine = SEQ[:, 6 * backend.rank:6 * (backend.rank + 1)]
        for _ in range(3):
            module(mine, mine, mine, is_causal=True)
        return backend.stats.calls["all_gather"], backend.stats.bytes["all_gather"]

    assert spawn(run, 2) == [(3, 3 * 80)] * 2  # 10 int64 a rank


def test_ranks_holding_other_heads_are_an_error_naming_them():
    """Every rank of the ring must hold the same heads of a head-split model: routes follow from
    this rank's heads, and rank 1 holding heads 2..3 where rank 0 holds 0..1 gave each a wrong
    result without a word (errors of 0.4 and 1.9 in float64)."""
    def run(backend):
        lo = 2 * backend.rank
        module = RingDilatedAttention((8, 16), (2, 4), backend=backend, head_start=lo,
                                      total_heads=4)
        x = torch.randn(1, 8, 2, 4, dtype=torch.float64)
        module(x, x, x)

    with pytest.raises(ValueError, match=r"same heads.*rank 0: heads \[0, 2\) of 4; "
                                         r"rank 1: heads \[2, 4\) of 4"):
        spawn(run, 2)


@pytest.mark.parametrize("rank1", [dict(segment_lengths=(12, 6), dilation_rates=(3, 1)),
                                   dict(dilation_rates=(1,)),
                                   dict(softmax_scale=0.25)])
def test_ranks_built_with_other_branches_are_an_error_naming_them(rank1):
    """Routes follow from each rank's own branches and scale: rank 1 built with another branch,
    rate or softmax_scale than rank 0 met matching collectives and returned a wrong result
    without a word."""
    def run(backend):
        settings = dict(segment_lengths=(12,), dilation_rates=(3,), softmax_scale=None)
        if backend.rank == 1:
            settings.update(rank1)
        module = RingDilatedAttention(settings.pop("segment_lengths"),
                                      settings.pop("dilation_rates"), backend=backend, **settings)
        mine = SEQ[:, 6 * backend.rank:6 * (backend.rank + 1)]
        module(mine, mine, mine, is_causal=True)

    with pytest.raises(ValueError, match=r"same segment_lengths, dilation_rates and softmax_scale"
                                         r".*this rank \(\d\) has segment_lengths="):
        spawn(run, 2)
