"""Conformance checks of the differentiable collectives (distframe.backends.functional) that
depend on what an engine returns, run on every engine."""
from __future__ import annotations

import torch

from distframe.backends import functional as F


def check_functional_all_to_all_outputs_take_in_place_ops(backend) -> None:
    # Gloo and MPI return views of one receive buffer, the in-memory engine separate tensors;
    # an in-place op on one view of a multi-view autograd output raised on those engines only.
    n, r = backend.world_size, backend.rank
    chunks = [torch.full((j + 1, 2), float(r + 1), dtype=torch.float64, requires_grad=True)
              for j in range(n)]
    outs = F.all_to_all(chunks, backend)
    outs[0].mul_(2)
    sum(o.sum() for o in outs).backward()
    # Every rank's output 0 came from rank 0 (its chunk for that rank) and was doubled there.
    for chunk in chunks:
        torch.testing.assert_close(chunk.grad, torch.full_like(chunk, 2.0 if r == 0 else 1.0), rtol=0, atol=0)
    torch.testing.assert_close(outs[0], torch.full((r + 1, 2), 2.0, dtype=torch.float64), rtol=0, atol=0)


def check_functional_gathered_last_dim_takes_in_place_ops(backend) -> None:
    # Where every leading dim is 1 (one row, a 1-d input), the moved-back gather is contiguous
    # already, and contiguous() handed out a view made inside the Function: an in-place op after
    # it (nn.ReLU(inplace=True) after a gathered column layer) raised.
    n, r = backend.world_size, backend.rank
    for shape in [(1, 2), (2,), (1, 1, 2), (3, 2)]:
        x = torch.full(shape, float(r + 1), dtype=torch.float64, requires_grad=True)
        y = F.gather_from_parallel_region(x, backend)
        y.mul_(2)
        (y * y).sum().backward()
        want = torch.cat([torch.full(shape, 2.0 * (k + 1), dtype=torch.float64) for k in range(n)], dim=-1)
        torch.testing.assert_close(y, want, rtol=0, atol=0)
        # d/dx of sum((2x)^2) is 8x on this rank's own slice only.
        torch.testing.assert_close(x.grad, 8 * x.detach(), rtol=0, atol=0)
