"""Differentiable collectives at world size 4 and on shapes the base tests do not use (0-dim
inputs, transposed views, empty all_to_all chunks): float64 gradcheck of the whole group's
function (see test_functional)."""
import pytest

from distframe.backends import functional as F
from tests.backends.test_functional import _gradcheck


@pytest.mark.parametrize("world_size", [1, 4])
def test_all_gather_of_0_dim_inputs(world_size):
    _gradcheck(lambda x, b: F.all_gather(x * (b.rank + 1), b) ** 2, world_size, ())


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_gather_and_reduce_scatter_of_transposed_views(world_size):
    _gradcheck(lambda x, b: F.reduce_scatter(F.all_gather(x.t() * (b.rank + 1), b).sin(), b),
               world_size, (2, 3))


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_avg_of_transposed_views(world_size):
    _gradcheck(lambda x, b: F.all_reduce(x.t() * (b.rank + 1), b, "AVG") ** 2, world_size, (2, 3))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_to_all_with_empty_chunks(world_size):
    def rank_fn(x, b):
        # rank r sends (r + j) % 2 rows to rank j: some chunks, and so some outputs, are empty
        chunks = [x[: (j + b.rank) % 2] * (j + 1) for j in range(b.world_size)]
        return [o.exp() for o in F.all_to_all(chunks, b)]
    _gradcheck(rank_fn, world_size, (2, 2))
