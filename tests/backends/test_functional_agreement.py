"""Ranks that disagree about autograd around a differentiable collective raise, rather than pair
a backward's collective with some other call ([Note: ranks that disagree about autograd] in
distframe.backends.functional). Before, a rank whose input was frozen skipped the backward
all_reduce, which then paired with that rank's next plain all_reduce: both ranks' gradients
came out wrong without a word."""
import functools

import pytest
import torch

from distframe.backends import functional as F
from distframe.errors import CollectiveMismatchError
from distframe.launch import spawn


def _caught(fn, b):
    try:
        return ("ok", fn(b))
    except CollectiveMismatchError as exc:
        return ("mismatch", str(exc))


def _outcomes(fn, backend="inmemory", **kwargs):
    return spawn(functools.partial(_caught, fn), 2, backend, timeout=10, **kwargs)


def _frozen_on_rank_1(b):
    x = torch.ones(3, dtype=torch.float64, requires_grad=b.rank == 0)
    w_grad = torch.full((3,), float(b.rank + 1), dtype=torch.float64)
    y = F.all_reduce(x, b)
    if y.requires_grad:
        y.sum().backward()
    b.all_reduce(w_grad)  # the plain call the backward's all_reduce paired with
    return w_grad.tolist()


@pytest.mark.parametrize("backend,kwargs", [("inmemory", {}), ("gloo", {}), ("gloo", {"debug": True})])
def test_an_input_that_requires_grad_on_some_ranks_only_is_a_mismatch(backend, kwargs):
    # Gloo without debug: the ranks share a node, whose call slots compare signatures.
    outcomes = _outcomes(_frozen_on_rank_1, backend, **kwargs)
    assert [kind for kind, _ in outcomes] == ["mismatch", "mismatch"], outcomes
    # Rank 0 names its own call in full; a process that never made the tagged call knows its
    # arguments only by their digest, and says what they can be.
    assert "autograd=all_reduce, recording a backward" in outcomes[0][1]
    assert "autograd=all_reduce, recording a backward" in outcomes[1][1] or (
        "the autograd pass of a distframe.backends.functional call" in outcomes[1][1])


def test_a_backward_collective_never_pairs_with_a_plain_call():
    # Rank 1 does not use the output (no backward collective there) and calls a plain
    # all_reduce of the same shape, the one rank 0's backward met.
    def fn(b):
        x = torch.ones(3, dtype=torch.float64, requires_grad=True)
        y = F.all_reduce(x, b)
        if b.rank == 0:
            y.sum().backward()
        else:
            b.all_reduce(torch.ones(3, dtype=torch.float64))
    outcomes = _outcomes(fn)
    assert [kind for kind, _ in outcomes] == ["mismatch", "mismatch"], outcomes
    assert "autograd=backward of all_reduce" in outcomes[0][1]


def test_ranks_that_disagree_about_create_graph_are_a_mismatch():
    def fn(b):
        x = torch.ones(3, dtype=torch.float64, requires_grad=True)
        y = F.all_gather(x, b)
        (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=b.rank == 0)
        return g.tolist()
    outcomes = _outcomes(fn)
    assert [kind for kind, _ in outcomes] == ["mismatch", "mismatch"], outcomes
    assert "backward of all_gather, recording a backward" in outcomes[0][1]


def test_calls_that_record_nothing_pair_with_plain_calls():
    # Under no_grad (or with inputs that need no grad) a differentiable collective is a plain
    # one: mixing the two is no error, and the sums are right.
    def fn(b):
        x = torch.full((3,), float(b.rank + 1), dtype=torch.float64)
        if b.rank == 0:
            return F.all_reduce(x, b).tolist()
        return b.all_reduce(x).tolist()
    assert _outcomes(fn) == [("ok", [3.0] * 3)] * 2


def test_agreeing_ranks_train_as_before():
    def fn(b):
        x = torch.full((2,), float(b.rank + 1), dtype=torch.float64, requires_grad=True)
        (F.all_reduce(x, b) * torch.tensor([1.0, 2.0], dtype=torch.float64)).sum().backward()
        grad = x.grad.clone()
        b.all_reduce(grad)
        return grad.tolist()
    assert _outcomes(fn) == [("ok", [4.0, 8.0])] * 2


def test_scatter_to_parallel_region_of_a_0_dim_tensor_says_what_to_pass():
    def fn(b):
        with pytest.raises(ValueError, match="at least one dim"):
            F.scatter_to_parallel_region(torch.tensor(1.0), b)
    spawn(fn, 2)
