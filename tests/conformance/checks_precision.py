"""Conformance checks of reduced precision: what a reduction of float16 or bfloat16 rounds, and
when. Run on every engine by test_collectives.py, like the checks in checks.py."""
from __future__ import annotations

import numpy as np
import torch

from distframe.backends import ReduceOp
from tests.conformance.oracle import assert_matches, input_device


def check_low_precision_average(backend) -> None:
    """AVG of float16 is the mean rounded once to float16: near float16's largest value (65504)
    the sum of the ranks' values overflows float16, their mean does not. all_reduce,
    reduce_scatter and reduce alike, each with a synchronous and an asynchronous call."""
    n, r, device = backend.world_size, backend.rank, input_device()
    values = [65504.0 - 32 * k for k in range(n)]  # each exactly a float16
    expected = np.full(4, np.mean(values))  # assert_matches rounds it to float16 once
    for async_op in (False, True):
        mine = torch.full((4,), values[r], dtype=torch.float16, device=device)
        work = backend.all_reduce(mine, ReduceOp.AVG, async_op=async_op)
        if async_op:
            work.wait()
        assert_matches(mine, expected, "float16", f"all_reduce AVG async_op={async_op}")
        rows = torch.full((4 * n,), values[r], dtype=torch.float16, device=device)
        work = backend.reduce_scatter(rows, ReduceOp.AVG, async_op=async_op)
        assert_matches(work.wait() if async_op else work, expected, "float16",
                       f"reduce_scatter AVG async_op={async_op}")
        chunk = torch.empty(4, dtype=torch.float16, device=device)
        backend.reduce_scatter(rows, ReduceOp.AVG, out=chunk)
        assert_matches(chunk, expected, "float16", "reduce_scatter AVG into out")
        mine = torch.full((2, 4), values[r], dtype=torch.float16, device=device).t()
        work = backend.reduce(mine, n - 1, ReduceOp.AVG, async_op=async_op)
        if async_op:
            work.wait()
        assert_matches(mine, np.full((4, 2), np.mean(values) if r == n - 1 else values[r]), "float16",
                       f"reduce AVG of a transposed view, async_op={async_op}")
