"""Ranks that leave while their peers wait for them, on the Gloo and MPI engines (worlds of 2 and 3):
a rank whose function returned, that shut a backend down, or that failed, without making the call
its peers wait in, stops them at once (CollectiveTimeoutError naming the call and the rank, or
RankFailedError) instead of at the timeout (30 s here); ranks that end at slightly different
times after completing every call cause no error. See distframe/backends/departures.py.

Run as a module under torchrun (``python -m torch.distributed.run ... -m
tests.backends.test_departures``), this file is the program of the torchrun test.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from distframe._process_launch import ProcessPool
from distframe.errors import CollectiveTimeoutError, RankFailedError
from distframe.launch import init_backend, spawn

TIMEOUT = 30.0  # every backend's timeout in this module
PROMPT = 10.0  # an error that came sooner was caused by the departure, not by the timeout
REPO_ROOT = Path(__file__).resolve().parents[2]
POOLS = [pytest.param((engine, world), marks=getattr(pytest.mark, engine), id=f"{engine}-{world}")
         for engine in ("gloo", "mpi") for world in (2, 3)]


@pytest.fixture(scope="module", params=POOLS)
def pool(request):
    engine, world = request.param
    if engine == "gloo":
        made = ProcessPool(world, "gloo", timeout=TIMEOUT)
    else:
        pytest.importorskip("mpi4py", reason="the MPI engine needs the [mpi] extra (mpi4py, mpich)")
        from distframe._mpi_launch import MPIPool
        made = MPIPool(world, timeout=TIMEOUT)
    with made:
        yield made


# ---- what the ranks run ------------------------------------------------------------------------
def _outcome(call):
    """What ``call()`` did on a waiting rank, and how long it took."""
    start = time.monotonic()
    try:
        call()
    except CollectiveTimeoutError as exc:
        return "timeout", exc.op, exc.seq, exc.missing_ranks, time.monotonic() - start, str(exc)
    except RankFailedError as exc:
        return "failed", exc.failed_rank, time.monotonic() - start, str(exc)
    return "completed", time.monotonic() - start


def _signal_and_wait(signals: str, rank: int, world_size: int, leaver: int) -> None:
    """Peers drop a file once they have their outcome; the leaver stays until they all have."""
    if rank != leaver:
        Path(signals, f"rank{rank}").touch()
        return
    deadline = time.monotonic() + TIMEOUT + 10
    peers = [Path(signals, f"rank{r}") for r in range(world_size) if r != leaver]
    while time.monotonic() < deadline and not all(p.exists() for p in peers):
        time.sleep(0.05)


def rank_leave_while_peers_wait(b, where: str, how: str, signals: str):
    """The last rank leaves without making the call its peers wait in: its function returns
    (``how`` "return"), or it shuts down the backend the call is made on or the one that backend
    was made from, and stays until its peers have their outcome ("shutdown"). The call is an
    all_reduce (the post-first path), a broadcast from the leaver or a reduce_scatter (whose Gloo
    wait cannot be sliced) on that backend, or a barrier on a subgroup of it whose rank order is
    reversed. Waiting ranks return (the op, sequence number and missing ranks they expect, what
    happened)."""
    leaver = b.world_size - 1
    if how == "return":
        owner = b
    elif b.engine == "mpi":  # as in a script that mpiexec started
        owner = init_backend("mpi", timeout=TIMEOUT)
    else:  # not the pool's own backend, which serves the other tests of this module
        owner = b.new_group(list(range(b.world_size)))
    reversed_ranks = list(range(b.world_size))[::-1]
    group = owner.new_group(reversed_ranks) if where == "subgroup barrier" else owner
    if b.rank == leaver:
        if how == "shutdown":
            owner.shutdown()
            _signal_and_wait(signals, b.rank, b.world_size, leaver)
        return None
    op = "barrier" if where == "subgroup barrier" else where
    leaver_there = reversed_ranks.index(leaver) if group is not owner else leaver
    expected = (op, group.stats.total_calls() + 1, [leaver_there])
    calls = {"all_reduce": lambda: group.all_reduce(torch.ones(3)),
             "broadcast": lambda: group.broadcast(torch.ones(3, dtype=torch.float64), leaver_there),
             "reduce_scatter": lambda: group.reduce_scatter(torch.ones(2 * group.world_size)),
             "subgroup barrier": lambda: group.barrier()}
    outcome = _outcome(calls[where])
    if how == "shutdown":
        _signal_and_wait(signals, b.rank, b.world_size, leaver)
        owner.shutdown()
    return expected, outcome


def rank_leave_before_new_group(b):
    """The last rank returns; the others call new_group over every rank, the leaver included."""
    leaver = b.world_size - 1
    b.barrier()
    if b.rank == leaver:
        return None
    expected = ("new_group", b.stats.total_calls() + 1, [leaver])
    return expected, _outcome(lambda: b.new_group(list(range(b.world_size))[::-1]))


def rank_receive_from_one_that_left(b, call: str):
    """The last rank sends rank 0 one message (tag 3) and returns. Rank 0, once it has left,
    receives that message, then waits for a second one (``recv`` or ``irecv(...).wait()``) that
    never comes. Rank 0 returns (what it received first, how its second wait ended)."""
    leaver = b.world_size - 1
    b.barrier()
    if b.rank == leaver:
        b.send(torch.full((3,), 7.0), 0, tag=3)
        return None
    if b.rank != 0:
        return None
    time.sleep(1.0)  # the leaver has returned (and departed) by now
    first = b.recv(torch.zeros(3), leaver, tag=3).tolist()
    second = {"recv": lambda: b.recv(torch.zeros(3), leaver, tag=3),
              "irecv": lambda: b.irecv(torch.zeros(3), leaver, tag=3).wait()}[call]
    return first, _outcome(second)


def rank_send_to_one_that_left(b, numel: int, signals: str):
    """On a subgroup of every rank, the last rank receives one message (tag 5) of ``numel``
    float32 from rank 0, departs, and stays until rank 0 has its outcome. Rank 0 sends it that
    message and a second one, then shuts the subgroup down. Rank 0 returns its engine, how its
    second send, and then its shutdown, ended, and the warnings they raised."""
    leaver = b.world_size - 1
    group = b.new_group(list(range(b.world_size)))
    outcome = None
    if b.rank == leaver:
        group.recv(torch.zeros(numel), 0, tag=5)
        group.depart()
    elif b.rank == 0:
        group.send(torch.ones(numel), leaver, tag=5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outcome = _outcome(lambda: group.send(torch.ones(numel), leaver, tag=5)), _outcome(group.shutdown)
        outcome = (b.engine, *outcome, [str(w.message) for w in caught])
    _signal_and_wait(signals, b.rank, b.world_size, leaver)
    return outcome


def rank_shut_down_before_a_send_is_received(b):
    """Rank 0 sends the last rank a message on a subgroup and shuts it down at once; the last
    rank receives it late and returns. Returns (what was received, the warnings raised)."""
    group = b.new_group(list(range(b.world_size)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if b.rank == 0:
            group.send(torch.full((3,), 2.0), b.world_size - 1, tag=6)
            group.shutdown()
        elif b.rank == b.world_size - 1:
            time.sleep(0.6)
            return group.recv(torch.zeros(3), 0, tag=6).tolist(), [str(w.message) for w in caught]
    return None, [str(w.message) for w in caught]


def rank_fail_after_sending(b, signals: str):
    """The last rank sends rank 0 one message (tag 7), departs as failed and stays until rank 0
    has its outcome. Rank 0 returns the message it received, and how its wait for a second ended."""
    leaver = b.world_size - 1
    b.barrier()
    outcome = None
    if b.rank == leaver:
        b.send(torch.full((3,), 7.0), 0, tag=7)
        b.depart(failed=True)
    elif b.rank == 0:
        time.sleep(1.0)  # the leaver has departed by now
        outcome = b.recv(torch.zeros(3), leaver, tag=7).tolist(), _outcome(
            lambda: b.recv(torch.zeros(3), leaver, tag=7))
    _signal_and_wait(signals, b.rank, b.world_size, leaver)
    return outcome


def rank_depart_as_failed(b, signals: str):
    """The last rank announces that it failed and stays; its peers wait in an all_reduce."""
    leaver = b.world_size - 1
    b.barrier()
    if b.rank == leaver:
        b.depart(failed=True)
    outcome = None if b.rank == leaver else _outcome(lambda: b.all_reduce(torch.ones(2)))
    _signal_and_wait(signals, b.rank, b.world_size, leaver)
    return outcome


def rank_return_while_peers_wait(b):
    if b.rank != b.world_size - 1:
        b.all_reduce(torch.ones(2))


def rank_raise_while_peers_wait(b):
    b.barrier()
    if b.rank == b.world_size - 1:
        raise ValueError("the last rank gives up")
    b.all_reduce(torch.ones(2))


def rank_last_arrives_late(b):
    """Every rank completes every call; the last rank enters the last two late, while the others
    wait in them (a reduce_scatter too, which the Gloo board watches past 0.2 s and must not cut),
    and each rank returns as soon as its call is done."""
    b.all_reduce(torch.ones(2))
    if b.rank == b.world_size - 1:
        time.sleep(0.6)
    total = b.all_reduce(torch.ones(2))[0].item()
    if b.rank == b.world_size - 1:
        time.sleep(0.6)
    return total, b.reduce_scatter(torch.ones(2 * b.world_size)).tolist()


def rank_last_call_left_running(b):
    """The last rank issues its last call asynchronously, late, and returns without waiting for
    it: the call still runs, so the peers waiting in it complete."""
    b.barrier()
    if b.rank == b.world_size - 1:
        time.sleep(0.6)
        b.all_reduce(torch.ones(2), async_op=True)
        return None
    return b.all_reduce(torch.ones(2))[0].item()


# ---- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["return", "shutdown"])
@pytest.mark.parametrize("where", ["all_reduce", "broadcast", "reduce_scatter", "subgroup barrier"])
def test_peers_waiting_for_a_rank_that_left_stop_at_once(pool, tmp_path, where, how):
    results = pool.run(rank_leave_while_peers_wait, where, how, str(tmp_path))
    assert results[-1] is None
    for expected, outcome in results[:-1]:
        assert outcome[:4] == ("timeout", *expected), outcome
        elapsed, text = outcome[4:]
        assert elapsed < PROMPT and f"rank {expected[2][0]} left" in text, text
        assert "before its timeout" in text and "timed out" not in text, text  # it did not time out


def test_new_group_stops_at_once_when_a_member_left_without_calling_it(pool):
    results = pool.run(rank_leave_before_new_group)
    assert results[-1] is None
    for expected, outcome in results[:-1]:
        assert outcome[:4] == ("timeout", *expected), outcome
        elapsed, text = outcome[4:]
        assert elapsed < PROMPT and f"rank {expected[2][0]} left" in text, text
        assert "before its timeout" in text and "timed out" not in text, text  # it did not time out


@pytest.mark.parametrize("call", ["recv", "irecv"])
def test_a_receive_from_a_rank_that_left_without_sending_stops_at_once(pool, call):
    results = pool.run(rank_receive_from_one_that_left, call)
    leaver = len(results) - 1
    first, outcome = results[0]
    assert first == [7.0] * 3  # sent before it left: still delivered
    assert outcome[:4] == ("timeout", "recv", 2, [leaver]), outcome
    elapsed, text = outcome[4:]
    assert elapsed < PROMPT and f"rank {leaver} left" in text, text


@pytest.mark.parametrize("numel", [3, 2**20])
def test_a_send_to_a_rank_that_left_without_receiving_it_waits_for_no_timeout(pool, tmp_path, numel):
    """Gloo's sends are buffered: the send returns, and shutdown drops it at once with a warning.
    MPI's small sends are buffered; a large one (rendezvous) needs the receiver and stops at once."""
    engine, send, shutdown, caught = pool.run(rank_send_to_one_that_left, numel, str(tmp_path))[0]
    leaver = pool.world_size - 1
    assert shutdown[0] == "completed" and shutdown[-1] < PROMPT, shutdown
    if engine == "mpi" and numel > 3:
        assert send[:4] == ("timeout", "send", 2, [leaver]), send
        assert send[4] < PROMPT and f"rank {leaver} left" in send[5], send
        assert caught == []
        return
    assert send[0] == "completed" and send[1] < PROMPT, send
    if engine == "gloo":
        assert len(caught) == 1 and f"1 message with tag 5 to rank {leaver}" in caught[0], caught
    else:
        assert caught == []


def test_a_send_received_after_the_sender_shut_down_raises_and_warns_nothing(pool):
    results = pool.run(rank_shut_down_before_a_send_is_received)
    assert results[-1] == ([2.0] * 3, [])
    assert all(caught == [] for _, caught in results[:-1]), results


def test_a_rank_that_fails_after_sending_delivers_the_message_then_stops_its_receiver(pool, tmp_path):
    first, outcome = pool.run(rank_fail_after_sending, str(tmp_path))[0]
    leaver = pool.world_size - 1
    assert first == [7.0] * 3  # sent before it failed: still delivered
    assert outcome[:2] == ("failed", leaver), outcome
    assert outcome[2] < PROMPT and "recv (message 2 with tag 7" in outcome[3], outcome


def test_a_rank_that_departs_as_failed_stops_its_peers_with_rank_failed_error(pool, tmp_path):
    results = pool.run(rank_depart_as_failed, str(tmp_path))
    world = len(results)
    assert results[-1] is None
    for kind, failed_rank, elapsed, text in results[:-1]:
        assert (kind, failed_rank) == ("failed", world - 1), text
        assert elapsed < PROMPT and "all_reduce (sequence number" in text, text


def test_ranks_ending_at_different_times_raise_nothing(pool):
    world = pool.world_size
    for _ in range(2):  # the second run must not see the first run's departures
        assert pool.run(rank_last_arrives_late) == [(float(world), [float(world)] * 2)] * world
    assert pool.run(rank_last_call_left_running) == [float(world)] * (world - 1) + [None]


@pytest.mark.parametrize("engine", [pytest.param("gloo", marks=pytest.mark.gloo),
                                    pytest.param("mpi", marks=pytest.mark.mpi)])
def test_spawn_stops_ranks_waiting_for_one_that_returned(engine):
    if engine == "mpi":
        pytest.importorskip("mpi4py", reason="the MPI engine needs the [mpi] extra (mpi4py, mpich)")
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        spawn(rank_return_while_peers_wait, 3, engine, timeout=TIMEOUT)
    assert time.monotonic() - start < TIMEOUT  # starting the processes takes a few seconds
    assert (info.value.op, info.value.seq, info.value.missing_ranks) == ("all_reduce", 1, [2])
    assert info.value.timeout < PROMPT  # how long rank 0 waited
    with pytest.raises(ValueError, match="the last rank gives up") as info:
        spawn(rank_raise_while_peers_wait, 3, engine, timeout=TIMEOUT)
    assert any("raised on rank 2" in note for note in info.value.__notes__)


# ---- torchrun ----------------------------------------------------------------------------------
_KEPT = []  # keeps the backend of torchrun_main alive to the end of the process


def torchrun_main() -> None:
    """Rank 1 leaves while rank 0 waits in an all_reduce (DISTFRAME_TEST_LEAVE): it shuts its
    backend down and stays until rank 0 has reported ("shutdown"), or returns from the script
    without shutting down, the backend still referenced, while a thread keeps its process alive
    until then ("linger") or not ("exit")."""
    backend = init_backend("gloo", timeout=TIMEOUT)
    _KEPT.append(backend)
    backend.barrier()
    signals, how = os.environ["DISTFRAME_TEST_SIGNALS"], os.environ["DISTFRAME_TEST_LEAVE"]
    if backend.rank == 0:
        print("OUTCOME", repr(_outcome(lambda: backend.all_reduce(torch.ones(2)))[:5]), flush=True)
        _signal_and_wait(signals, 0, 2, 1)
        backend.shutdown()
    elif how == "shutdown":
        backend.shutdown()
        _signal_and_wait(signals, 1, 2, 1)
    elif how == "linger":
        threading.Thread(target=_signal_and_wait, args=(signals, 1, 2, 1)).start()


@pytest.mark.gloo
@pytest.mark.parametrize("how", ["shutdown", "linger", "exit"])
def test_a_rank_that_leaves_under_torchrun_stops_its_waiting_peer(tmp_path, how):
    env = dict(os.environ, OMP_NUM_THREADS="1", DISTFRAME_TEST_SIGNALS=str(tmp_path),
               DISTFRAME_TEST_LEAVE=how,
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "tests.backends.test_departures"]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.findall(r"OUTCOME \('(\w+)', '?(\w+)'?, (\d+), \[(\d)\], ([\d.]+)\)", done.stdout)
    assert len(found) == 1, done.stdout[-3000:]
    kind, op, seq, missing, elapsed = found[0]
    assert (kind, op, seq, missing) == ("timeout", "all_reduce", "2", "1")
    assert float(elapsed) < PROMPT


if __name__ == "__main__":
    torchrun_main()


def test_a_failed_rank_of_a_subgroup_is_named_in_the_world_too():
    # The MPI and torch.distributed engines build RankFailedError in the subgroup's numbering:
    # under mpiexec every peer of a hybrid model's failed rank 2 blamed "rank 1" (or "rank 0").
    from distframe.backends.departures import in_world
    from distframe.errors import RankFailedError

    error = in_world(RankFailedError(1, "all_reduce (sequence number 3): it raised and left the group"), [0, 2])
    assert isinstance(error, RankFailedError) and error.failed_rank == 1
    assert str(error) == ("rank 1 failed: global rank 2 of the world this group was made from; all_reduce "
                          "(sequence number 3): it raised and left the group; this rank stopped")
    assert in_world(error, [0, 2]) is error  # named once
    same = RankFailedError(1, "x")
    assert in_world(same, [0, 1]) is same and in_world(same, None) is same
