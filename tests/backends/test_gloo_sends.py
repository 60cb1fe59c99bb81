"""Gloo's buffered sends: ``send`` returns once its payload is copied, and a Gloo send reports
completion only to a wait, so the engine must itself let go of what was received (before its
SendWaiter, every payload a rank sent stayed in memory until shutdown: a pipeline's activations,
async SGD's gradients, each step)."""
from __future__ import annotations

import time

import pytest
import torch

from distframe._process_launch import ProcessPool

pytestmark = pytest.mark.gloo


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(3, "gloo", timeout=60) as pool:
        yield pool


def held_sends(b) -> int:
    """How many sent payloads the engine still holds (its own bookkeeping, read to see that it
    lets go of what was received)."""
    return b._sends.held()


def rank_sends_released(b, messages):
    right, left = (b.rank + 1) % b.world_size, (b.rank - 1) % b.world_size
    for i in range(messages):
        b.send(torch.full((1000,), float(i)), right, tag=7)
        b.recv(torch.empty(1000), left, tag=7)
    b.barrier()  # every message has been received
    deadline = time.monotonic() + 30
    while held_sends(b) and time.monotonic() < deadline:
        time.sleep(0.01)
    return held_sends(b)


def test_received_sends_are_let_go(pool):
    assert pool.run(rank_sends_released, 40) == [0, 0, 0]

