"""A rank function that calls sys.exit or returns what cannot be pickled, on threads (in-memory)
and processes (Gloo pool): the caller gets an error naming the rank and what to change, never a
SystemExit that would end it."""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch

from distframe import spawn
from distframe._mpi_launch import MPIPool
from distframe.errors import RankFailedError


def exit_on_rank(backend, rank: int, code):
    if backend.rank == rank:
        sys.exit(code)
    return backend.all_reduce(torch.ones(1)).item()


def rank_sum(backend):
    return backend.all_reduce(torch.tensor([float(backend.rank)])).item()


@pytest.mark.parametrize("rank,code", [(0, 0), (1, 3), (2, "bye")])
def test_sys_exit_on_an_in_memory_rank_is_a_rank_failure(rank, code):
    # Before: SystemExit(code) reached the caller, so a script ended silently, with status 0
    # for sys.exit(0): a failed run passed off as a success.
    with pytest.raises(RankFailedError, match=rf"rank {rank} failed: .*sys\.exit\({code!r}\)") as info:
        spawn(lambda b: exit_on_rank(b, rank, code), 3, timeout=20)
    assert info.value.failed_rank == rank
    assert isinstance(info.value.__cause__, SystemExit) and info.value.__cause__.code == code


@pytest.fixture(scope="module", params=[pytest.param("gloo", marks=pytest.mark.gloo),
                                        pytest.param("mpi", marks=pytest.mark.mpi)])
def pool(request):
    """Two rank processes: a Gloo ProcessPool, or an MPIPool under mpiexec."""
    if request.param == "gloo":
        from distframe._process_launch import ProcessPool
        pool = ProcessPool(2, "gloo", timeout=20)
    else:
        pool = MPIPool(2, timeout=20)
    yield pool
    pool.close()


def test_sys_exit_on_a_process_rank_is_a_rank_failure_and_the_pool_goes_on(pool):
    for rank, code in [(0, 0), (1, 3)]:
        with pytest.raises(RankFailedError, match=rf"sys\.exit\({code}\)") as info:
            pool.run(exit_on_rank, rank, code)
        assert info.value.failed_rank == rank
    assert pool.run(rank_sum) == [float(np.arange(2).sum())] * 2


def lock_on_rank_one(backend):
    backend.barrier()
    return threading.Lock() if backend.rank == 1 else backend.rank


def test_a_result_that_cannot_be_pickled_is_named_and_the_pool_goes_on(pool):
    # Before: "cannot pickle '_thread.lock' object" with a traceback into the pool's own code,
    # which read as a failure inside the function or in distframe.
    with pytest.raises(TypeError, match=r"'lock_on_rank_one' returned a lock that cannot be pickled "
                                        r"back to the caller .*return tensors") as info:
        pool.run(lock_on_rank_one)
    assert "raised on rank 1" in "".join(info.value.__notes__)
    assert pool.run(rank_sum) == [float(np.arange(2).sum())] * 2


def raise_with_an_async_call_pending(backend):
    if backend.rank == 0:
        backend.all_reduce(torch.ones(1), async_op=True)  # rank 1 never makes this call
    raise ValueError(f"rank {backend.rank} stops")


def test_an_async_failure_left_by_a_raising_function_stays_in_its_run(pool):
    # Before: rank 0's pending all_reduce failed after its function had raised, and the failure
    # was raised by the first call of the next run, which had done nothing wrong.
    with pytest.raises(ValueError, match="rank 0 stops"):
        pool.run(raise_with_an_async_call_pending)
    assert pool.run(rank_sum) == [float(np.arange(2).sum())] * 2


def raise_with_a_message_unreceived(backend):
    if backend.rank == 0:
        backend.send(torch.tensor([1.0]), 1, tag=4)  # buffered: returns before rank 1 receives
    raise ValueError(f"rank {backend.rank} stops")  # rank 1 before its receive


def send_and_receive(backend, value: float):
    if backend.rank == 0:
        backend.send(torch.tensor([value]), 1, tag=4)
        return value
    return backend.recv(torch.zeros(1), 0, tag=4).item()


def test_a_message_left_unreceived_by_a_raising_run_is_not_the_next_runs(pool):
    # Before: the pool kept its workers, and the next run's first receive on that channel got
    # the failed run's message (1.0) instead of its own (2.0), without a word.
    with pytest.raises(ValueError, match="rank 0 stops"):
        pool.run(raise_with_a_message_unreceived)
    assert pool.run(send_and_receive, 2.0) == [2.0, 2.0]


def spawn_gloo_inside(backend):
    from distframe.errors import ConfigError
    try:
        return spawn(rank_sum, 2, "gloo", timeout=20)
    except ConfigError as exc:
        return str(exc)


def test_a_gloo_spawn_inside_a_gloo_rank_is_refused_with_the_alternatives(pool):
    # Before: multiprocessing's "daemonic processes are not allowed to have children". An MPI
    # rank is no daemon: there the inner spawn runs.
    outcomes = pool.run(spawn_gloo_inside)
    if isinstance(pool, MPIPool):
        assert outcomes == [[1.0, 1.0]] * 2
        return
    for message in outcomes:
        assert "inside a rank of a spawned process group" in message and "new_group" in message, message
