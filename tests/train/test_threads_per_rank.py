"""In-memory ranks share the cores this process may use, no more than torch's own thread count.

``os.cpu_count()`` alone gave one rank every core of the machine against the user's
``OMP_NUM_THREADS=1`` or ``taskset -c 0``: a world-size-1 run was 6x slower on a contended
machine."""
from __future__ import annotations

import os

import pytest
import torch

from distframe.train import _threads_per_rank


@pytest.mark.parametrize("allowed,started,world,expected", [
    ({0}, 4, 1, 1),             # taskset -c 0
    ({0, 1, 2, 3}, 1, 1, 1),    # OMP_NUM_THREADS=1
    ({0, 1, 2, 3}, 4, 2, 2),    # four cores shared by two ranks
    ({0, 1, 2, 3}, 4, 8, 1),    # at least one each
])
def test_ranks_share_the_cores_the_process_may_use(monkeypatch, allowed, started, world, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: allowed, raising=False)
    previous = torch.get_num_threads()
    torch.set_num_threads(started)
    try:
        with _threads_per_rank(world):
            assert torch.get_num_threads() == expected
        assert torch.get_num_threads() == started
    finally:
        torch.set_num_threads(previous)


def test_overlapping_runs_leave_the_thread_count_they_found(monkeypatch):
    # Two runs of train.run on threads of one process: B began while A ran and saved A's reduced
    # count as its own "before", and restored that last, leaving every later thread 1 thread.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    previous = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        first, second = _threads_per_rank(2), _threads_per_rank(4)
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        second.__exit__(None, None, None)
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(previous)
