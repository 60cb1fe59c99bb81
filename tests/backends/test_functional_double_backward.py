"""Second derivatives through the differentiable collectives (gradient penalties, Hessian-vector
products, MAML): the backward of each collective must itself be differentiable, as
torch.distributed.nn.functional's are. float64 gradcheck of the whole group's first-order
gradient (each rank's own x -> d(its loss)/dx, cross-rank terms included), see test_functional."""
import pytest
import torch

from distframe.backends import functional as F
from distframe.backends import InMemoryCommunicationBackend
from tests.backends.test_functional import _ReplicatedFunction, _gradcheck


def _first_order(rank_fn, replicated=False):
    """x -> the gradient of every rank's sum(rank_fn(x) * weights), with create_graph=True:
    every rank runs its backward at once (they communicate), each keeps the graph of its own.
    The weights differ by rank unless ``replicated`` (every rank then computes the same loss)."""
    def grad_fn(x, b):
        outs = rank_fn(x, b)
        outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
        loss = sum((o * torch.linspace(0.5, 1.5, o.numel(), dtype=o.dtype).view_as(o)
                    * (1 if replicated else b.rank + 1)).sum() for o in outs)
        # x ** 3 keeps a local second-order term: without it a backward that is not differentiable
        # raises instead of silently dropping the collective's part of the second derivative.
        return torch.autograd.grad(loss + (x ** 3).sum(), x, create_graph=True)[0]
    return grad_fn


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_all_gather_and_reduce_scatter_second_derivatives(world_size):
    _gradcheck(_first_order(lambda x, b: F.reduce_scatter(F.all_gather(x, b) ** 2, b) ** 2),
               world_size, (2, 2))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_all_reduce_second_derivatives(world_size, op):
    _gradcheck(_first_order(lambda x, b: F.all_reduce(x * x, b, op) ** 2), world_size, (3,))


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_to_all_second_derivatives(world_size):
    def rank_fn(x, b):
        chunks = [x[: (j + b.rank) % 2 + 1] ** 2 for j in range(b.world_size)]  # uneven sizes
        return [o ** 2 for o in F.all_to_all(chunks, b)]
    _gradcheck(_first_order(rank_fn), world_size, (2, 2))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_megatron_regions_second_derivatives(world_size):
    """Under the regions' convention (test_functional._ReplicatedFunction): a replicated x, one
    loss that every rank computes alike, and so a replicated gradient, differentiated again."""
    def rank_fn(x, b):
        w = torch.arange(1.0, 5.0, dtype=x.dtype).view(2, 2) * (b.rank + 1)
        h = (F.copy_to_parallel_region(x, b) @ w) ** 2  # a column-parallel piece per rank
        out = F.reduce_from_parallel_region(h, b) ** 2
        sliced = F.scatter_to_parallel_region(torch.cat([out] * b.world_size, dim=-1), b)
        return F.gather_from_parallel_region(sliced.sin(), b)
    backends = InMemoryCommunicationBackend.create_group(world_size, timeout=30)
    x = torch.randn(2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0),
                    requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda t: _ReplicatedFunction.apply(_first_order(rank_fn, replicated=True), backends, t),
        (x,), eps=1e-6, atol=1e-8)
