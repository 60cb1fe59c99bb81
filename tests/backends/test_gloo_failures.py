"""Gloo engine failure paths: timeouts that name the missing ranks, debug-mode mismatches, ranks
that raise or die under spawn, use after shutdown, and a real torchrun launch.

Run as a module under torchrun (``python -m torch.distributed.run ... -m
tests.backends.test_gloo_failures``), this file is the program of that launch test.
"""
from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distframe._process_launch import ProcessPool, spawn_processes
from distframe.backends import GlooCommunicationBackend
from distframe.backends.torch_dist import visible_gpus
from distframe.errors import CollectiveMismatchError, CollectiveTimeoutError, RankFailedError
from distframe.launch import init_backend, spawn
from tests.backends.late_rank import check_late_for_a_call, late_for_a_call

pytestmark = pytest.mark.gloo
REPO_ROOT = Path(__file__).resolve().parents[2]


# ---- rank functions (run in the workers) ----------------------------------------------------------
def rank_pid_and_sum(b):
    return os.getpid(), b.all_reduce(torch.tensor([float(b.rank)])).item()


def rank_late_rank_two(b):
    b.barrier()
    if b.rank == 2:
        time.sleep(3.5)
        return None
    start = time.monotonic()
    try:
        b.all_reduce(torch.ones(3))
    except CollectiveTimeoutError as exc:
        return exc.op, exc.seq, exc.missing_ranks, exc.timeout, time.monotonic() - start, str(exc)
    return "completed"


def rank_recv_nobody_sends(b):
    if b.rank == 0:  # stays past rank 1's timeout: a rank that left would stop its receive at once
        time.sleep(2.0)
        return None
    try:
        b.irecv(torch.empty(2), 0, tag=3).wait(timeout=0.5)
    except CollectiveTimeoutError as exc:
        return exc.op, exc.seq, exc.missing_ranks, exc.timeout
    return "completed"


def rank_raise_timeout(b):
    raise CollectiveTimeoutError("all_reduce", 7, [1], 2.0, "raised on purpose")


def rank_mismatch(b, kind):
    t = torch.ones(4)
    try:
        if b.rank != 1:
            b.all_reduce(t)
        elif kind == "op":
            b.all_gather(t)
        elif kind == "shape":
            b.all_reduce(torch.ones(5))
        else:
            b.all_reduce(t.double())
    except CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def rank_p2p_mismatch(b):
    try:
        if b.rank == 0:
            b.send(torch.ones(4), 1)
        elif b.rank == 1:
            b.recv(torch.empty(3, dtype=torch.float64), 0)
    except CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def rank_queue_behind_a_failed_async_call(b):
    """On a fresh subgroup (its numbering stays its own), every rank makes an asynchronous
    all_reduce that fails the debug check; rank 0 alone queues an all_gather behind it, which no
    peer joins. Rank 0 reports whether the barrier that raised the failure left it running."""
    sub = b.new_group(list(range(b.world_size)))
    try:
        sub.all_reduce(torch.ones(5 if sub.rank == 1 else 4), async_op=True)
        queued = sub.all_gather(torch.ones(1), async_op=True) if sub.rank == 0 else None
        try:
            sub.barrier()
        except CollectiveMismatchError:
            pass
        if queued is None:
            return None
        done = queued.is_completed()
        try:
            queued.wait()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return done, str(exc)
        return done, "ran"
    finally:
        sub.shutdown()


def rank_use_after_shutdown(b):
    sub = b.new_group(list(range(b.world_size)))
    sub.barrier()
    sub.shutdown()
    sub.shutdown()  # idempotent
    try:
        sub.all_reduce(torch.ones(1))
    except ValueError as exc:
        return str(exc)
    return "no error"


def rank_one_raises(b):
    if b.rank == 1:
        raise ValueError("bad value on purpose")
    b.barrier()  # never completes: rank 1 is gone
    return b.rank


def rank_zero_dies(b):
    if b.rank == 0:
        os._exit(7)
    b.barrier()


def rank_two_killed_while_its_peers_wait(b, where: str):
    """Global rank 2 is SIGKILLed while rank 0 waits for it in a receive in subgroup [0, 2] and
    rank 1 in an all_reduce of subgroup [1, 2] (in both, rank 2 is the group's rank 1, and rank 1
    reports it as "rank 1 failed"); each writes what it raised to ``where.<rank>``."""
    import signal
    groups = [b.new_group([0, 2]), b.new_group([1, 2])]
    b.barrier()
    if b.rank == 2:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        if b.rank == 1:
            groups[1].all_reduce(torch.ones(3))
        else:
            groups[0].recv(torch.zeros(4), src=1)
    except RankFailedError as exc:
        Path(f"{where}.{b.rank}").write_text(f"{exc.failed_rank}|{exc}")
        raise


# ---- timeouts -----------------------------------------------------------------------------------------
def test_timeout_names_missing_rank_on_every_waiting_rank_and_pool_recovers():
    with ProcessPool(3, "gloo", timeout=2) as pool:
        pids_before = [pid for pid, _ in pool.run(rank_pid_and_sum)]  # sequence number 1
        results = pool.run(rank_late_rank_two)  # a barrier (2), then the all_reduce (3)
        assert results[2] is None
        for op, seq, missing, timeout, elapsed, text in results[:2]:
            assert (op, seq, missing, timeout) == ("all_reduce", 3, [2], 2.0)
            assert 1.5 <= elapsed <= 4.0
            assert "ranks [2] did not arrive" in text and "sequence number 3" in text
        # The timed-out group is unusable: the pool starts fresh workers for the next run.
        after = pool.run(rank_pid_and_sum)
        assert [total for _, total in after] == [3.0] * 3
        assert not set(pids_before) & {pid for pid, _ in after}


def test_a_rank_late_for_a_call_its_peers_gave_up_on_stops_at_once_naming_the_same_call():
    # It used to get RankFailedError with Gloo's "Connection closed by peer".
    with ProcessPool(3, "gloo", timeout=1.0) as pool:
        check_late_for_a_call(pool.run(late_for_a_call))


def test_errors_keep_their_type_and_attributes_across_processes():
    with ProcessPool(2, "gloo", timeout=10) as pool:
        with pytest.raises(CollectiveTimeoutError) as info:
            pool.run(rank_raise_timeout)
        assert (info.value.op, info.value.seq, info.value.missing_ranks) == ("all_reduce", 7, [1])
        assert any("rank 0" in note for note in info.value.__notes__)
        assert pool.run(rank_recv_nobody_sends) == [None, ("recv", 1, [0], 0.5)]


# ---- debug-mode mismatches ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def debug_pool():
    with ProcessPool(3, "gloo", timeout=30, debug=True) as pool:
        yield pool


@pytest.mark.parametrize("kind, words", [("op", "all_gather"), ("shape", "(5,)"),
                                         ("dtype", "float64")])
def test_debug_mismatch_raises_on_every_rank(debug_pool, kind, words):
    pids = [pid for pid, _ in debug_pool.run(rank_pid_and_sum)]
    messages = debug_pool.run(rank_mismatch, kind)
    for text in messages:
        assert "ranks disagree" in text and words in text, text
        # Ranks 0 and 2 made the same call: grouped on every rank, this rank's own included.
        assert "ranks [0, 2] called" in text and f"this rank (rank {messages.index(text)})" in text, text
    # The signature check runs before any data moves: the same group goes on working.
    assert debug_pool.run(rank_pid_and_sum) == [(pid, 3.0) for pid in pids]


def rank_receives_waited_out_of_order(b):
    if b.rank == 0:
        b.send(torch.tensor([1.0]), 1)
        b.send(torch.tensor([2.0]), 1)
    if b.rank != 1:
        return None
    a, c = torch.zeros(1), torch.zeros(1)
    first, second = b.irecv(a, 0), b.irecv(c, 0)
    second.wait()
    first.wait()
    return a.item(), c.item()


def test_debug_receives_waited_out_of_order_take_their_messages_in_posting_order(debug_pool):
    # Debug mode posted each payload's receive on the user's tag when it was waited for, so
    # Gloo matched payloads in wait order: (2.0, 1.0). Receives match in posting order (MPI's rule).
    assert debug_pool.run(rank_receives_waited_out_of_order)[1] == (1.0, 2.0)


def test_debug_point_to_point_mismatch_raises_on_the_receiver(debug_pool):
    messages = debug_pool.run(rank_p2p_mismatch)
    assert messages[0] == "no error" and messages[2] == "no error"
    assert "rank 0 sent send(shape=(4,), dtype=float32" in messages[1]
    assert "expects send(shape=(3,), dtype=float64)" in messages[1]


def test_calls_queued_behind_a_failed_async_call_are_not_left_running(debug_pool):
    pids = [pid for pid, _ in debug_pool.run(rank_pid_and_sum)]
    done, text = debug_pool.run(rank_queue_behind_a_failed_async_call)[0]
    assert done and "all_gather (sequence number 2) was not run" in text, text
    assert debug_pool.run(rank_pid_and_sum) == [(pid, 3.0) for pid in pids]


def test_debug_mode_receive_polled_with_is_completed_completes(debug_pool):
    # In debug mode the payload's receive is posted only once its header has arrived, so
    # is_completed() of a receive stayed False for good unless something waited for it.
    from tests.conformance.checks_async import check_polled_receive_completes
    debug_pool.run(check_polled_receive_completes)


def test_use_after_shutdown_raises_value_error(debug_pool):
    for text in debug_pool.run(rank_use_after_shutdown):
        assert "after shutdown()" in text


def test_use_after_shutdown_in_process():
    b = GlooCommunicationBackend(0, 1, torch.distributed.HashStore(), timeout=5)
    with b:
        b.barrier()
    assert b.is_shut_down
    b.shutdown()
    with pytest.raises(ValueError, match="after shutdown"):
        b.all_gather(torch.ones(1))
    with pytest.raises(ValueError, match="after shutdown"):
        b.isend(torch.ones(1), 0)


# ---- spawn --------------------------------------------------------------------------------------------
def test_spawn_returns_results_in_rank_order():
    before = set(multiprocessing.active_children())  # e.g. a module's pool
    results = spawn(rank_pid_and_sum, 3, "gloo", timeout=20)
    assert [total for _, total in results] == [3.0] * 3
    assert len({pid for pid, _ in results}) == 3
    assert set(multiprocessing.active_children()) <= before  # all joined


def test_spawn_reraises_a_rank_error_with_the_rank_named_and_leaks_nothing():
    before = set(multiprocessing.active_children())  # e.g. a module's pool
    start = time.monotonic()
    with pytest.raises(ValueError, match="bad value on purpose") as info:
        spawn_processes(rank_one_raises, 3, "gloo", timeout=60)
    assert time.monotonic() - start < 20  # the ranks stuck in the barrier were stopped
    assert any("raised on rank 1" in note for note in info.value.__notes__)
    assert set(multiprocessing.active_children()) <= before  # all joined


def test_spawn_reports_a_rank_that_died():
    before = set(multiprocessing.active_children())  # e.g. a module's pool
    with pytest.raises(RankFailedError, match="exited with code 7") as info:
        spawn(rank_zero_dies, 2, "gloo", timeout=60)
    assert info.value.failed_rank == 0
    assert set(multiprocessing.active_children()) <= before  # all joined


def test_spawn_names_the_rank_that_was_killed_not_a_peer_it_stopped(tmp_path):
    # Before: every rank reported a RankFailedError (the killed rank's from the launcher), and the
    # lowest rank's, naming its subgroup's rank 1 ("rank 1 failed: recv ...: Connection closed"),
    # was re-raised: world rank 1 is alive, and rank 2 was named nowhere. (Nor is a peer's error
    # that names its own rank, rank 1's here, the launcher's for a process that exited.)
    import functools
    where = tmp_path / "rank0.txt"
    with pytest.raises(RankFailedError, match="exited with code -9") as info:
        spawn(functools.partial(rank_two_killed_while_its_peers_wait, where=str(where)), 3, "gloo", timeout=60)
    assert info.value.failed_rank == 2
    assert "global rank 2 of the world this group was made from" in Path(f"{where}.0").read_text()


def rank_sigint_handler(b):
    import signal
    return signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_rank_processes_take_ctrl_c_though_their_forkserver_ignores_it():
    # The forkserver starts with SIGINT ignored ([Note: the forkserver and Ctrl-C]), so a Ctrl-C
    # while it imports torch prints no traceback; the rank processes it forks must not inherit that.
    assert spawn(rank_sigint_handler, 2, "gloo", timeout=60) == [True, True]


def test_unpicklable_function_fails_in_the_caller():
    before = set(multiprocessing.active_children())  # e.g. a module's pool
    with pytest.raises(Exception, match="pickle|lambda"):
        spawn(lambda b: b.rank, 2, "gloo", timeout=10)
    assert set(multiprocessing.active_children()) <= before  # all joined


def test_closed_pool_refuses_to_run():
    pool = ProcessPool(1, "gloo", timeout=10)
    pool.close()
    pool.close()
    with pytest.raises(ValueError, match="closed"):
        pool.run(rank_pid_and_sum)


# ---- torchrun -----------------------------------------------------------------------------------------
def torchrun_main() -> None:
    """The program each torchrun worker runs."""
    backend = init_backend("auto", timeout=60)
    t = backend.all_reduce(torch.tensor([float(backend.rank + 1)]))
    sub = backend.new_group([1, 0])
    print(f"RESULT {type(backend).__name__} {backend.rank} {backend.world_size} {t.item()} "
          f"{sub.rank}", flush=True)
    backend.shutdown()


def test_init_backend_auto_under_torchrun():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "tests.backends.test_gloo_failures"]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    # the two workers share one stdout, so their lines may interleave
    lines = sorted(re.findall(r"RESULT \w+ \d \d [\d.]+ \d", done.stdout))
    # NCCL only where each of the two processes has a GPU of its own (one GPU: Gloo, not a
    # duplicate-GPU failure)
    engine = "NCCLCommunicationBackend" if visible_gpus() >= 2 else "GlooCommunicationBackend"
    assert lines == [f"RESULT {engine} 0 2 3.0 1", f"RESULT {engine} 1 2 3.0 0"]


if __name__ == "__main__":
    torchrun_main()
