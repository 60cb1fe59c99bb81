"""Differentiable collectives: torch.autograd.gradcheck in float64 of the whole group's function.

gradcheck needs one function of all inputs; `_GroupFunction` runs the forward of every rank on
the in-memory engine's threads and the backward likewise (each rank's backward communicates), so
the Jacobian checked is that of the distributed computation as a whole, cross-rank terms included.
"""
import threading

import pytest
import torch

from distframe.backends import InMemoryCommunicationBackend
from distframe.backends import functional as F


def _on_ranks(backends, fn):
    results, errors = [None] * len(backends), []

    def run(b):
        try:
            results[b.rank] = fn(b)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            b.world.abort(b.rank, exc)
    threads = [threading.Thread(target=run, args=(b,)) for b in backends]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


class _GroupFunction(torch.autograd.Function):
    """(x_0, ..., x_{n-1}) -> flattened outputs of every rank, through the real collectives."""

    @staticmethod
    def forward(ctx, rank_fn, backends, *inputs):
        graphs = [None] * len(backends)

        def forward_rank(b):
            x = inputs[b.rank].detach().requires_grad_()
            with torch.enable_grad():
                outs = rank_fn(x, b)
                outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
            graphs[b.rank] = (x, outs)
            return [o.detach() for o in outs]
        per_rank = _on_ranks(backends, forward_rank)
        ctx.graphs, ctx.backends, ctx.counts = graphs, backends, [len(o) for o in per_rank]
        return tuple(o for outs in per_rank for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        starts = [sum(ctx.counts[:r]) for r in range(len(ctx.counts))]

        def backward_rank(b):
            x, outs = ctx.graphs[b.rank]
            g = grads[starts[b.rank]:starts[b.rank] + ctx.counts[b.rank]]
            return torch.autograd.grad(outs, x, g, retain_graph=True)[0]
        return (None, None, *_on_ranks(ctx.backends, backward_rank))


def _gradcheck(rank_fn, world_size, shape):
    backends = InMemoryCommunicationBackend.create_group(world_size, timeout=30)
    gen = torch.Generator().manual_seed(world_size)
    inputs = [torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
              for _ in range(world_size)]
    assert torch.autograd.gradcheck(
        lambda *xs: _GroupFunction.apply(rank_fn, backends, *xs), inputs, eps=1e-6, atol=1e-8)


WORLDS = [1, 2, 3]


@pytest.mark.parametrize("world_size", WORLDS)
def test_all_gather_gradcheck(world_size):
    _gradcheck(lambda x, b: F.all_gather(x * (b.rank + 1), b) ** 2, world_size, (2, 3))


@pytest.mark.parametrize("world_size", WORLDS)
def test_reduce_scatter_gradcheck(world_size):
    _gradcheck(lambda x, b: F.reduce_scatter(x.sin() * (b.rank + 1), b), world_size, (2 * world_size, 2))


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_all_reduce_gradcheck(world_size, op):
    _gradcheck(lambda x, b: F.all_reduce(x * x * (b.rank + 1), b, op) * (b.rank + 2), world_size, (4,))


@pytest.mark.parametrize("world_size", WORLDS)
def test_all_to_all_gradcheck(world_size):
    def rank_fn(x, b):
        chunks = [x[: j + 1] * (j + 1 + b.rank) for j in range(b.world_size)]  # uneven sizes
        return [o.exp() for o in F.all_to_all(chunks, b)]
    _gradcheck(rank_fn, world_size, (world_size, 2))


class _ReplicatedFunction(torch.autograd.Function):
    """Megatron's regions assume the input and the output's cotangent are replicated (every rank
    of the tensor-parallel group holds the same values): x -> the (replicated) output, with every
    rank's backward given the same cotangent and every rank returning the same gradient."""

    @staticmethod
    def forward(ctx, rank_fn, backends, x):
        def forward_rank(b):
            xr = x.detach().clone().requires_grad_()
            with torch.enable_grad():
                return xr, rank_fn(xr, b)
        ctx.graphs, ctx.backends = _on_ranks(backends, forward_rank), backends
        outs = [o.detach() for _, o in ctx.graphs]
        for o in outs[1:]:
            torch.testing.assert_close(o, outs[0], rtol=0, atol=0)
        return outs[0]

    @staticmethod
    def backward(ctx, grad):
        grads = _on_ranks(ctx.backends, lambda b: torch.autograd.grad(
            ctx.graphs[b.rank][1], ctx.graphs[b.rank][0], grad, retain_graph=True)[0])
        for g in grads[1:]:
            torch.testing.assert_close(g, grads[0], rtol=1e-12, atol=1e-12)
        return None, None, grads[0]


@pytest.mark.parametrize("world_size", WORLDS)
def test_megatron_regions_gradcheck(world_size):
    def rank_fn(x, b):
        w = torch.arange(1.0, 7.0, dtype=x.dtype).view(3, 2) * (b.rank + 1)
        local = F.copy_to_parallel_region(x, b) @ w  # a column-parallel piece per rank
        out = F.reduce_from_parallel_region(local.tanh(), b)
        sliced = F.scatter_to_parallel_region(torch.cat([out] * b.world_size, dim=-1), b)
        return F.gather_from_parallel_region(sliced.sin(), b)
    backends = InMemoryCommunicationBackend.create_group(world_size, timeout=30)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: _ReplicatedFunction.apply(rank_fn, backends, t), (x,),
                                    eps=1e-6, atol=1e-8)


def test_megatron_regions_match_the_dense_layer():
    """Column-parallel then row-parallel linear through f and g equals the dense MLP, float64."""
    torch.manual_seed(0)
    x = torch.randn(5, 8, dtype=torch.float64)
    w1, w2 = torch.randn(8, 12, dtype=torch.float64), torch.randn(12, 8, dtype=torch.float64)
    dense = torch.relu(x @ w1) @ w2
    backends = InMemoryCommunicationBackend.create_group(3, timeout=30)

    def rank_fn(b):
        cols = slice(4 * b.rank, 4 * b.rank + 4)
        h = torch.relu(F.copy_to_parallel_region(x, b) @ w1[:, cols])
        return F.reduce_from_parallel_region(h @ w2[cols], b)
    for out in _on_ranks(backends, rank_fn):
        torch.testing.assert_close(out, dense, rtol=1e-12, atol=1e-12)


def test_differentiable_all_reduce_rejects_max():
    b = InMemoryCommunicationBackend(0, 1)
    with pytest.raises(ValueError, match="SUM and AVG"):
        F.all_reduce(torch.ones(1), b, "max")


@pytest.mark.parametrize("name", ["all_gather", "reduce_scatter", "all_reduce", "copy_to_parallel_region",
                                  "reduce_from_parallel_region", "scatter_to_parallel_region",
                                  "gather_from_parallel_region"])
def test_the_none_group_of_a_non_member_is_named(name):
    # new_group gives None to ranks outside the group; it failed with "'NoneType' object has no
    # attribute 'all_gather'".
    with pytest.raises(ValueError, match=rf"^{name}: the backend is None, which new_group returns"):
        getattr(F, name)(torch.ones(2, requires_grad=True), None)
    with pytest.raises(ValueError, match=r"^all_to_all: the backend is None"):
        F.all_to_all([torch.ones(2)], None)
