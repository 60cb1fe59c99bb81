"""A Gloo backend or subgroup that is dropped without ``shutdown()`` lets go of its threads and
sockets once it is garbage. Before, its finalizer only departed: each forgotten world backend kept
its 'distframe-progress' thread and store connection, and each group that had sent a message its
'distframe-sends' thread, which held the last send's work and with it the process group's sockets
(a hybrid model built and dropped per run left one thread and ~5 fds per rank, for good)."""
from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch

from distframe._process_launch import ProcessPool

pytestmark = pytest.mark.gloo
FD_SLACK = 2  # a store connection or two may come and go meanwhile; a leak is one per group or more


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(2, "gloo", timeout=60) as pool:
        yield pool


def used(group) -> None:
    """One collective and one message to the next rank (received, so the send completes)."""
    group.all_reduce(torch.ones(3))
    group.send(torch.full((4,), float(group.rank)), (group.rank + 1) % group.world_size)
    group.recv(torch.empty(4), (group.rank - 1) % group.world_size)


def forget_world_backends(b, count: int, name: str) -> None:
    """World backends of the pool's processes, each with a subgroup; the world is dropped first,
    and its subgroup still works (the progress board they share outlives it)."""
    from distframe.backends import GlooCommunicationBackend
    for i in range(count):
        world = GlooCommunicationBackend(b.rank, b.world_size, b._shared.store, timeout=20,
                                         prefix=f"test-gloo-collected/{name}/{i}", **b._sibling_kwargs())
        used(world)
        sub = world.new_group(list(range(b.world_size)))
        used(sub)
        del world  # collected at once (no cycle holds it)
        used(sub)
        b.barrier()  # every rank has received what the dropped groups sent


def forget_subgroups(b, count: int, name: str) -> None:
    """Subgroups of the pool's world (``name``, for the same signature, is not needed)."""
    for _ in range(count):
        used(b.new_group(list(range(b.world_size))))
        b.barrier()


def resources() -> tuple[list[str], int]:
    """This process's distframe threads (by name) and open file descriptors."""
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith("distframe-"))
    return names, len(os.listdir("/proc/self/fd"))


def rank_resources_after_forgetting(b, kind: str, count: int):
    """(threads, fds) after one group was forgotten (lazy one-time allocations happen there), then
    after ``count`` more, once they are collected and their threads have ended."""
    forget = {"world": forget_world_backends, "subgroup": forget_subgroups}[kind]
    forget(b, 1, f"{kind}-warm-up")
    gc.collect()
    before = resources()
    forget(b, count, kind)
    deadline = time.monotonic() + 5
    while True:  # a sends thread ends once its last send has been seen to complete
        gc.collect()
        after = resources()
        if (after[0] == before[0] and after[1] <= before[1] + FD_SLACK) or time.monotonic() > deadline:
            return before, after
        time.sleep(0.02)


@pytest.mark.parametrize("kind", ["world", "subgroup"])
def test_forgotten_groups_release_threads_and_sockets(pool, kind):
    for (threads_before, fds_before), (threads_after, fds_after) in pool.run(
            rank_resources_after_forgetting, kind, 6):
        assert threads_after == threads_before
        assert fds_after <= fds_before + FD_SLACK, (fds_before, fds_after)
