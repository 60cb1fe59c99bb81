"""A subgroup's timeout names its missing ranks in the group's numbering and in the world's.

In new_group([2, 1, 0]) global rank 0 is the subgroup's rank 2, and global rank 2 its rank 0. A
waiting rank's error said only "ranks [2] did not arrive", although global rank 2 was one of those
waiting; the in-memory engine named the global rank only on the rank whose own timeout fired, Gloo
and MPI never. Every engine now names them both ways on every waiting rank, in one wording, and
so does an asynchronous call's expired ``Work.wait(timeout=...)``.
"""
from __future__ import annotations

import re
import time

import pytest
import torch

from distframe.errors import CollectiveTimeoutError
from distframe.launch import spawn
from tests.backends.mpi_pools import mpi_pool_fixture

ORDER = [2, 1, 0]  # subgroup rank -> global rank
NOTE = "ranks [2] did not arrive; that is, global ranks [0] of the world this group was made from"


def _failure(call) -> tuple[str, list[int] | None, str] | str:
    try:
        call()
    except CollectiveTimeoutError as exc:
        return type(exc).__name__, exc.missing_ranks, str(exc)
    return "completed"


def late_and_leaving_rank(b):
    """Global rank 0 (rank 2 of each subgroup) is late for a call on one subgroup, past the
    timeout, then leaves another without making its call."""
    found = {}
    late = b.new_group(ORDER)
    if b.rank == 0:
        time.sleep(b.timeout * 1.5)
    else:
        found["late"] = _failure(lambda: late.all_reduce(torch.ones(4)))
    b.barrier()
    slow = b.new_group(ORDER)  # late by less than the timeout: a Work.wait(timeout=...) expires
    if b.rank == 0:
        time.sleep(b.timeout * 0.6)
        slow.all_reduce(torch.ones(4))
    else:
        work = slow.all_reduce(torch.ones(4), async_op=True)
        found["expired"] = _failure(lambda: work.wait(timeout=b.timeout * 0.1))
        work.wait()
    b.barrier()
    leaving = b.new_group(ORDER)
    if b.rank == 0:
        leaving.shutdown()
    else:
        found["left"] = _failure(lambda: leaving.all_reduce(torch.ones(4)))
    b.barrier()
    return found


def _check(results: list[dict]) -> None:
    assert results[0] == {}
    for rank in (1, 2):
        for case in ("late", "left", "expired"):
            kind, missing, text = results[rank][case]
            assert kind == "CollectiveTimeoutError" and missing == [2], (rank, case, text)
            assert NOTE in text, (rank, case, text)
        text = results[rank]["late"][2]
        who = re.search(r"rank (\d+) (\(global rank (\d+)\) )?gave up", text)
        if who is not None and "this rank gave up" not in text:  # a peer gave up first
            assert who.group(3) is not None, text
            assert ORDER[int(who.group(1))] == int(who.group(3)) != rank, text
        assert "left the group" in results[rank]["left"][2]
        assert "Work.wait(timeout=...) expired" in results[rank]["expired"][2]


def test_inmemory():
    _check(spawn(late_and_leaving_rank, 3, timeout=0.5))


@pytest.mark.gloo
def test_gloo():
    _check(spawn(late_and_leaving_rank, 3, "gloo", timeout=2.0))


pool = mpi_pool_fixture(3, timeout=2.0)


@pytest.mark.mpi
def test_mpi(pool):
    _check(pool.run(late_and_leaving_rank))
