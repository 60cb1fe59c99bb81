"""A fresh MPI group never receives what was sent on one shut down before it.

MPICH hands a freed communicator's context id to the next one made, and a message still queued
for the old one then matched the new one: a fresh backend's receive or broadcast returned the
old group's data, with no error ([Note: freeing a communicator] in distframe/backends/mpi_retire.py).
Each case below returned the stale [1.0, 1.0] instead of the [7.0, 7.0] sent to the new group.
"""
from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("mpi4py", reason="the MPI engine needs the [mpi] extra (mpi4py, mpich)")

from distframe._mpi_launch import MPIPool  # noqa: E402
from distframe.backends import mpi_retire  # noqa: E402
from distframe.errors import CollectiveTimeoutError  # noqa: E402
from distframe.launch import init_backend  # noqa: E402

pytestmark = pytest.mark.mpi
STALE, FRESH = [1.0, 1.0], [7.0, 7.0]


@pytest.fixture(scope="module")
def pool():
    with MPIPool(2, timeout=30) as p:
        yield p


# ---- what the ranks run ------------------------------------------------------------------------
def send_unreceived(b):
    """Rank 0 sends rank 1 a message (tag 5) that it never receives; the run ends normally."""
    if b.rank == 0:
        b.isend(torch.ones(2), 1, tag=5)
    b.barrier()
    return "done"


def receive_on_tag_five(b):
    """Rank 0 sends 7s on tag 5; rank 1 returns what its receive got."""
    if b.rank == 0:
        b.send(torch.full((2,), 7.0), 1, tag=5)
        return None
    return b.recv(torch.zeros(2), 0, tag=5).tolist()


def broadcast_then_fail(b):
    """Rank 0 broadcasts (its eager send completes at once); rank 1 raises instead of joining."""
    if b.rank == 1:
        raise ValueError("rank 1 raises before its broadcast")
    b.broadcast(torch.ones(2), 0)


def broadcast_sevens(b):
    t = torch.full((2,), 7.0) if b.rank == 0 else torch.zeros(2)
    return b.broadcast(t, 0).tolist()


def init_backend_twice(b):
    """Within one process under mpiexec: a broadcast rank 1 never joins on one backend, shut down;
    then a broadcast on a new one."""
    first = init_backend("mpi", timeout=30)
    if first.rank == 0:
        try:
            first.broadcast(torch.ones(2), 0)
        except CollectiveTimeoutError:
            pass  # sent, but rank 1 was seen leaving without it ([Note: calls a peer never made])
    first.shutdown()
    with init_backend("mpi", timeout=30) as second:
        return broadcast_sevens(second)


def new_group_after_one_shut_down(b):
    """A message left unreceived on a subgroup, shut down; then a receive on a new subgroup."""
    sub = b.new_group([0, 1])
    if sub.rank == 0:
        sub.isend(torch.ones(2), 1, tag=5)
    sub.barrier()
    sub.shutdown()
    return receive_on_tag_five(b.new_group([0, 1]))


def groups_made_and_shut_down(b, count):
    """``count`` groups that complete every message and collective: each communicator is freed
    (MPICH has a few thousand context ids); returns how many are kept and how many retiring."""
    for _ in range(count):
        with init_backend("mpi", timeout=30) as group:
            group.all_reduce(torch.ones(2))
            receive_on_tag_five(group)
    mpi_retire.free_retired()
    return len(mpi_retire._kept), len(mpi_retire._retiring)


def groups_made_and_dropped(b, count):
    """``count`` subgroups made, used and dropped without ``shutdown()`` (a group built per step):
    each was collected, but its communicator was never freed, and MPICH refused group 2043 with
    "Too many communicators". Returns how many communicators are kept for good."""
    for _ in range(count):
        group = b.new_group([0, 1])
        group.all_reduce(torch.ones(2))
        del group
    mpi_retire.free_retired()
    return len(mpi_retire._kept)


def new_group_after_one_dropped(b):
    """As new_group_after_one_shut_down, the first group dropped instead of shut down."""
    sub = b.new_group([0, 1])
    if sub.rank == 0:
        sub.isend(torch.ones(2), 1, tag=5)
    sub.barrier()
    del sub
    gc.collect()
    return receive_on_tag_five(b.new_group([0, 1]))


# ---- tests -------------------------------------------------------------------------------------
def test_a_message_left_unreceived_does_not_reach_the_next_run(pool):
    assert pool.run(send_unreceived) == ["done", "done"]
    assert pool.run(receive_on_tag_five) == [None, FRESH]


def test_a_broadcast_a_peer_never_joined_does_not_reach_the_next_run(pool):
    with pytest.raises(ValueError, match="rank 1 raises"):
        pool.run(broadcast_then_fail)
    assert pool.run(broadcast_sevens) == [FRESH, FRESH]


def test_a_second_init_backend_does_not_receive_the_first_ones_broadcast(pool):
    assert pool.run(init_backend_twice) == [FRESH, FRESH]


def test_a_new_subgroup_does_not_receive_what_was_left_on_one_shut_down(pool):
    assert pool.run(new_group_after_one_shut_down) == [None, FRESH]


def test_groups_whose_traffic_completed_are_freed(pool):
    kept_before = pool.run(groups_made_and_shut_down, 0)
    kept_after = pool.run(groups_made_and_shut_down, 200)
    for (kept0, _), (kept1, retiring) in zip(kept_before, kept_after):
        assert kept1 == kept0 and retiring <= 2  # nothing new kept; at most the last ones waiting


def test_groups_dropped_without_shutdown_are_freed(pool):
    kept_before = pool.run(groups_made_and_dropped, 0)
    assert pool.run(groups_made_and_dropped, 2100) == kept_before  # past MPICH's 2048 context ids


def test_a_new_subgroup_does_not_receive_what_was_left_on_one_dropped(pool):
    assert pool.run(new_group_after_one_dropped) == [None, FRESH]
