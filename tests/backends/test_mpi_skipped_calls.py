"""MPI: a rank that never makes a rooted collective its peers made is an error on the ranks that
made it, as on the other engines (CollectiveTimeoutError naming the op, its sequence number and the
rank that left). Here rank 0 only sends (the root of a broadcast or scatter, a non-root of a reduce
or gather), so MPI completes its part at once (small messages are sent eagerly) whether or not
rank 1 ever joins: it used to return as if the call had happened, and spawn reported success.

If rank 1 has already left when rank 0 makes the call, the call itself raises; if it leaves only
after the call has completed, the launcher raises when the run ends (see ``_confirm_rooted`` in
distframe/backends/mpi.py).

Also the other side of a rank leaving early: a receive it left posted keeps its buffer after its
backend is gone, for the message its peer sends later.
"""
from __future__ import annotations

import functools
import gc
import time
import weakref
from pathlib import Path

import pytest
import torch

pytest.importorskip("mpi4py", reason="the MPI engine needs the [mpi] extra (mpi4py, mpich)")

from distframe._mpi_launch import MPIPool  # noqa: E402
from distframe.backends.mpi import MPICommunicationBackend  # noqa: E402
from distframe.errors import CollectiveTimeoutError, RankFailedError  # noqa: E402
from distframe.launch import spawn  # noqa: E402

pytestmark = pytest.mark.mpi

TIMEOUT = 30.0
OPS = ["broadcast", "reduce", "gather", "scatter"]


def _call(b, op: str) -> None:
    """``op`` with rank 0 on the sending side only."""
    t = torch.ones(3)
    if op == "broadcast":
        b.broadcast(t, 0)
    elif op == "reduce":
        b.reduce(t, 1)
    elif op == "gather":
        b.gather(t, 1)
    else:
        b.scatter([t, t] if b.rank == 0 else None, 0)


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"gave up waiting for {what}")
        time.sleep(0.01)


def skip_after_peer_called(b, op: str, signals: str):
    """Rank 0 makes ``op`` and says so; rank 1 returns without it, once rank 0's part is done."""
    done = Path(signals, "rank0-called")
    if b.rank == 1:
        _wait_for(done.exists, "rank 0's call")
        return "left"
    _call(b, op)
    done.touch()
    return "called"


def skip_before_peer_calls(b, op: str):
    """Rank 1 returns without ``op``; rank 0 makes it once it has seen rank 1 leave, and reports
    what the call did."""
    if b.rank == 1:
        return "left"
    _wait_for(lambda: 1 in b.departures(), "rank 1 to leave")
    try:
        _call(b, op)
    except CollectiveTimeoutError as exc:
        return exc.op, exc.seq, exc.missing_ranks, str(exc)
    return "completed"


def call_late(b, op: str, signals: str):
    """Both ranks make ``op``; rank 1 only after rank 0's part has completed: no error."""
    done = Path(signals, "rank0-called")
    if b.rank == 1:
        _wait_for(done.exists, "rank 0's call")
    _call(b, op)
    if b.rank == 0:
        done.touch()
    return b.rank


def fail_before_the_call(b, signals: str):
    """Rank 1 raises after rank 0's broadcast has completed, without making it."""
    done = Path(signals, "rank0-called")
    if b.rank == 1:
        _wait_for(done.exists, "rank 0's call")
        raise KeyError("rank 1 gives up")
    _call(b, "broadcast")
    done.touch()
    return "called"


def receive_pending_at_shutdown(b):
    """Rank 0 drops a receive, shuts its group down and lets it go before rank 1 sends the
    message: whether the receive's buffer is still allocated then (MPI writes it when it comes)."""
    group = MPICommunicationBackend(b.comm, timeout=TIMEOUT)
    if group.rank == 1:
        b.barrier()  # rank 0's group is gone
        group.send(torch.arange(64.0), 0, tag=8)
        group.shutdown()
        return None
    target = torch.zeros(64)
    alive = weakref.ref(target)
    group.irecv(target, 1, tag=8)
    del target
    group.shutdown()
    del group
    gc.collect()
    b.barrier()
    return alive() is not None


def ranks_times_two(b):
    return 2 * b.rank


@pytest.fixture(scope="module")
def pool():
    with MPIPool(2, timeout=TIMEOUT) as p:
        yield p


@pytest.mark.parametrize("op", OPS)
def test_a_call_the_peer_left_without_making_raises_when_the_run_ends(pool, tmp_path, op):
    with pytest.raises(CollectiveTimeoutError) as info:
        pool.run(skip_after_peer_called, op, str(tmp_path))
    error = info.value
    assert (error.op, error.seq, error.missing_ranks) == (op, 1, [1]), error
    assert "rank 1 left the group after 0 calls" in str(error), error
    assert any("raised on rank 0" in note for note in error.__notes__), error.__notes__
    assert pool.run(ranks_times_two) == [0, 2]  # the job is still usable


@pytest.mark.parametrize("op", OPS)
def test_a_call_made_after_the_peer_left_raises_in_the_call(pool, op):
    outcome = pool.run(skip_before_peer_calls, op)[0]
    assert outcome[:3] == (op, 1, [1]), outcome
    assert "rank 1 left the group after 0 calls" in outcome[3], outcome
    assert pool.run(ranks_times_two) == [0, 2]


@pytest.mark.parametrize("op", OPS)
def test_a_peer_that_makes_the_call_late_is_no_error(pool, tmp_path, op):
    assert pool.run(call_late, op, str(tmp_path)) == [0, 1]


def test_a_peer_that_failed_before_the_call_is_the_error_raised(pool, tmp_path):
    with pytest.raises((KeyError, RankFailedError)) as info:
        pool.run(fail_before_the_call, str(tmp_path))
    assert isinstance(info.value, KeyError), info.value  # the original failure, not its echo
    assert any("raised on rank 1" in note for note in info.value.__notes__)


def test_a_receive_pending_at_shutdown_keeps_its_buffer_after_the_backend_is_gone(pool):
    # The buffer went with the backend while the receive stayed posted: the message then landed
    # in memory in other use (malloc aborted a rank in about a quarter of such runs).
    assert pool.run(receive_pending_at_shutdown) == [True, None]
    assert pool.run(ranks_times_two) == [0, 2]


def test_spawn_raises_for_a_call_a_rank_never_made(tmp_path):
    with pytest.raises(CollectiveTimeoutError) as info:
        spawn(functools.partial(skip_after_peer_called, op="broadcast", signals=str(tmp_path)), 2,
              "mpi", timeout=TIMEOUT)
    assert (info.value.op, info.value.seq, info.value.missing_ranks) == ("broadcast", 1, [1])
