"""vocab_parallel_cross_entropy and its targets: a class id outside the full vocabulary (other than
``ignore_index``) raises IndexError on every rank of the tensor group, as ``F.cross_entropy``
does, and targets whose shape is not the logits' without the vocabulary dim raise ValueError,
both before any collective (in-memory engine)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distframe.launch import spawn
from distframe.models.tensor_parallel_loss import vocab_parallel_cross_entropy

VOCAB = 12


def _logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, VOCAB, generator=g, dtype=torch.float64)


def _error_on_every_rank(world, logits, targets, error, **kwargs):
    """Each rank's message of ``error``; a rank that did not raise returns its loss instead."""
    def run(b):
        local = logits.chunk(b.world_size, dim=-1)[b.rank]
        try:
            return vocab_parallel_cross_entropy(local, targets, b, **kwargs)
        except error as exc:
            return str(exc)
    return spawn(run, world, timeout=30)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("bad, shown", [(VOCAB, f"[0, {VOCAB}]"), (-1, "[-1, 11]"), (-100, "[-100, 11]")])
def test_a_target_outside_the_vocabulary_raises_on_every_rank(world, bad, shown):
    logits = _logits()
    targets = torch.tensor([[0, 4, 11], [bad, 2, 3]])
    with pytest.raises(IndexError):  # the dense loss's behaviour that the parallel one follows
        F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-7)
    messages = _error_on_every_rank(world, logits, targets, IndexError, ignore_index=-7)
    for message in messages:
        assert isinstance(message, str), "this rank returned a loss instead of raising"
        assert f"target ids in {shown}" in message and f"vocabulary of {VOCAB}" in message


def test_ignored_targets_are_not_out_of_range():
    logits = _logits()
    targets = torch.tensor([[0, -100, 11], [-100, 2, 3]])
    expected = F.cross_entropy(logits.transpose(1, 2), targets)
    losses = spawn(lambda b: vocab_parallel_cross_entropy(logits.chunk(2, -1)[b.rank], targets, b), 2)
    for loss in losses:
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(2, 1), (6,), (2, 3, 1), (3, 2)])
def test_targets_of_another_shape_than_the_logits_raise(shape):
    # (2, 1) against logits (2, 3, V/t) used to broadcast: a loss of shape (2, 3), silently wrong.
    targets = torch.zeros(shape, dtype=torch.long)
    for message in _error_on_every_rank(2, _logits(), targets, ValueError):
        assert isinstance(message, str), "this rank returned a loss instead of raising"
        assert f"targets of shape {tuple(shape)}" in message and "(2, 3)" in message


def test_class_probability_targets_are_refused():
    targets = torch.softmax(_logits(), -1)[..., 0]
    for message in _error_on_every_rank(2, _logits(), targets, ValueError):
        assert isinstance(message, str) and "integer class ids" in message
