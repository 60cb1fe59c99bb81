"""VocabParallelEmbedding and token ids: an id outside the full vocabulary raises IndexError on
every rank of the tensor group (as ``nn.Embedding`` does on the CPU), before any collective, and
ids inside it give exactly ``nn.Embedding``'s output (in-memory engine); an embedding whose options
the split cannot honour (scale_grad_by_freq) is a ConfigError."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models.tensor_parallel import VocabParallelEmbedding
from distframe.models.tensor_parallel_model import TensorParallelModel
from tests.models.common import SEED_LOCK, tiny_lm

VOCAB = 12


def _embedding():
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Embedding(VOCAB, 5).double()


def _message_on_every_rank(world, build, ids):
    """Each rank's IndexError message; a rank that did not raise returns its output instead."""
    def run(b):
        layer = build(b)
        try:
            return layer(ids)
        except IndexError as exc:
            return str(exc)
    return spawn(run, world, timeout=30)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("ids, shown", [
    ([[0, -1, 3]], "[-1, 3]"),
    ([[VOCAB, 0], [1, 2]], f"[0, {VOCAB}]"),
    ([[VOCAB + 5, -3]], f"[-3, {VOCAB + 5}]"),
])
def test_an_id_outside_the_vocabulary_raises_on_every_rank(world, ids, shown):
    emb = _embedding()
    with pytest.raises(IndexError):
        emb(torch.tensor(ids))  # the dense layer's behaviour that the parallel one follows
    messages = _message_on_every_rank(
        world, lambda b: VocabParallelEmbedding.from_dense(emb, b), torch.tensor(ids))
    for message in messages:
        assert isinstance(message, str), "this rank returned an output instead of raising"
        assert f"token ids in {shown}" in message
        assert f"vocabulary of {VOCAB}" in message


def test_the_tensor_parallel_lm_refuses_an_id_past_its_vocabulary():
    ids = torch.zeros(2, 16, dtype=torch.long)
    ids[1, 7] = 256  # the tiny LM's vocabulary is 0..255
    messages = _message_on_every_rank(2, lambda b: TensorParallelModel(tiny_lm(), b), ids)
    assert all(isinstance(m, str) and "token ids in [0, 256]" in m for m in messages)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_ids_inside_the_vocabulary_give_exactly_the_dense_output(dtype):
    emb = _embedding()
    ids = torch.tensor([[0, VOCAB - 1, 5], [6, 11, 0]], dtype=dtype)
    empty = torch.zeros(0, 3, dtype=dtype)

    def run(b):
        layer = VocabParallelEmbedding.from_dense(emb, b)
        return layer(ids), layer(empty)
    for out, out_empty in spawn(run, 3, timeout=30):
        assert torch.equal(out, emb(ids))  # one row plus zeros from the other ranks: exact
        assert out_empty.shape == (0, 3, 5)


def test_an_embedding_that_scales_gradients_by_frequency_is_refused():
    # nn.Embedding(scale_grad_by_freq=True) divides each row's gradient by its id's count in the
    # batch; the parallel layer ignored the flag: the same output, silently other gradients.
    with SEED_LOCK:
        torch.manual_seed(0)
        emb = nn.Embedding(VOCAB, 5, scale_grad_by_freq=True).double()
    ids = torch.tensor([[1, 1, 1, 7]])
    emb(ids).sum().backward()
    assert emb.weight.grad[1, 0] == 1.0  # three uses, scaled by 1/3: the flag matters

    def run(b):
        VocabParallelEmbedding.from_dense(emb, b)

    with pytest.raises(ConfigError, match="scale_grad_by_freq"):
        spawn(run, 2, timeout=30)
    model = nn.Sequential(emb, nn.Linear(5, 2)).double()
    with pytest.raises(ConfigError, match="scale_grad_by_freq"):
        spawn(lambda b: TensorParallelModel(model, b, plan={"0": "vocab"}), 2, timeout=30)
