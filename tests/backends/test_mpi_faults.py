"""The MPI engine when things go wrong: timeouts that name the missing ranks, mismatches caught in
debug mode on every rank, failures re-raised by the launcher with the rank named, use after
shutdown, a missing mpi4py; plus init_backend under mpiexec and the host-staging helpers."""
from __future__ import annotations

import functools
import os
import sys
import time
import types

import pytest
import torch

pytest.importorskip("mpi4py", reason="the MPI engine needs the [mpi] extra (mpi4py, mpich)")

from distframe._mpi_launch import MPIPool, spawn_mpi  # noqa: E402
from distframe.backends.mpi import MPICommunicationBackend  # noqa: E402
from distframe.backends import mpi_retire  # noqa: E402
from distframe.backends.mpi_buffers import stage_back, stage_in, write_back  # noqa: E402
from distframe.errors import (BackendUnavailableError, CollectiveMismatchError,  # noqa: E402
                              CollectiveTimeoutError, ConfigError, RankFailedError)
from distframe.launch import init_backend, spawn  # noqa: E402
from tests.backends.late_rank import check_late_for_a_call, late_for_a_call  # noqa: E402

pytestmark = pytest.mark.mpi


def _outcome(fn):
    """Runs ``fn()`` on a rank and reports what it raised, so every rank's error comes back."""
    try:
        fn()
    except (CollectiveTimeoutError, CollectiveMismatchError) as exc:
        return type(exc).__name__, getattr(exc, "missing_ranks", None), exc.seq, str(exc)
    return None


# ---- functions the ranks run ---------------------------------------------------------------------
def run_timeout(b, absent):
    """Every rank but ``absent`` calls all_reduce as the group's second collective; ``absent``
    stays past their timeout (leaving would stop them at once: test_departures)."""
    with MPICommunicationBackend(b.comm, timeout=1.0) as fast:
        fast.barrier()
        if fast.rank == absent:
            time.sleep(2.5)
            return "skipped"
        start = time.monotonic()
        outcome = _outcome(lambda: fast.all_reduce(torch.ones(4)))
        return outcome, time.monotonic() - start


def run_late_new_group(b):
    """The last rank reaches new_group after the others timed out in it (they stay, not departed)."""
    with MPICommunicationBackend(b.comm.Split(0 if b.rank < 2 else 1, b.rank), timeout=1.0) as pair:
        if pair.world_size == 1:
            return None
        pair.all_reduce(torch.ones(1))
        if pair.rank == 1:
            time.sleep(2.0)
        start = time.monotonic()
        outcome = _outcome(lambda: pair.new_group([0, 1]))
        elapsed = time.monotonic() - start
        if pair.rank == 0:
            time.sleep(3.0)  # still in the group while the late rank is in new_group
        return outcome and outcome[0], elapsed


def run_late_for_a_call(b):
    with MPICommunicationBackend(b.comm, timeout=1.0) as fast:
        return late_for_a_call(fast)


def run_recv_timeout(b):
    with MPICommunicationBackend(b.comm, timeout=0.5) as fast:
        if fast.rank == 0:
            return _outcome(lambda: fast.recv(torch.empty(3), 1, tag=5))
    return None


def run_mismatch(b, kind):
    with MPICommunicationBackend(b.comm, timeout=20, debug=True) as checked:
        odd = checked.rank == checked.world_size - 1
        checked.all_reduce(torch.ones(2))  # agreeing calls pass
        if kind == "shape":
            call = lambda: checked.all_reduce(torch.ones(3 if odd else 2))  # noqa: E731
        elif kind == "dtype":
            call = lambda: checked.all_reduce(torch.ones(2, dtype=torch.float64 if odd else torch.float32))  # noqa: E731
        else:
            call = (lambda: checked.all_gather(torch.ones(2))) if odd else (lambda: checked.all_reduce(torch.ones(2)))
        outcome = _outcome(call)
        checked.barrier()  # the group is still consistent after the check
        return outcome


def run_p2p_mismatch(b, received):
    """Rank 0 sends 4 float32; rank 1 receives ``received`` of them."""
    if b.rank == 0:
        b.send(torch.arange(4.0), 1, tag=3)
        return None
    if b.rank == 1:
        return _outcome(lambda: b.recv(torch.empty(received), 0, tag=3))
    return None


def run_p2p_mismatch_polled(b, received):
    """As ``run_p2p_mismatch``, but rank 1 polls ``is_completed()`` before it waits: what polling
    raised (nothing is due), whether it said True, and what the wait raised."""
    if b.rank == 0:
        b.send(torch.arange(4.0), 1, tag=3)
    if b.rank != 1:
        return None
    work = b.irecv(torch.empty(received), 0, tag=3)
    deadline, completed, raised = time.monotonic() + 10.0, False, None
    while not completed and time.monotonic() < deadline:
        try:
            completed = work.is_completed()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            raised = f"{type(exc).__name__}: {exc}"
            break
        time.sleep(0.001)
    return raised, completed, _outcome(work.wait), _outcome(work.wait)


def run_recv_wait_expires_then_completes(b):
    """On a group of its own, rank 0's receive from rank 1 first waits with a timeout that
    expires (rank 1 waits for rank 0's go-ahead), then completes. Every rank shuts the group down
    and says whether its communicator was freed (once the peers' counts arrived), with what rank
    0 received."""
    from mpi4py import MPI
    group = MPICommunicationBackend(b.comm, timeout=30)
    got = torch.zeros(3)
    if group.rank == 0:
        work = group.irecv(got, 1, tag=2)
        with pytest.raises(CollectiveTimeoutError):
            work.wait(timeout=0.2)
        group.send(torch.ones(1), 1)
        work.wait()
    elif group.rank == 1:
        group.recv(torch.zeros(1), 0)
        group.send(torch.arange(3.0) + 1, 0, tag=2)
    comm = group.comm
    group.shutdown()
    b.barrier()  # every peer has shut it down: it is freed once their counts have arrived
    deadline = time.monotonic() + 10
    while comm != MPI.COMM_NULL and time.monotonic() < deadline:
        mpi_retire.free_retired()  # what building the next communicator does
        time.sleep(0.01)
    return comm == MPI.COMM_NULL, got.tolist()


def run_dropped_recv(b):
    """Rank 0 posts a receive and drops its Work and tensor before the message comes: MPI still
    writes into that memory, so it must stay allocated until the receive has completed."""
    import gc
    import weakref
    with MPICommunicationBackend(b.comm, timeout=20) as group:
        if group.rank == 0:
            target = torch.zeros(64)
            alive = weakref.ref(target)
            group.irecv(target, 1, tag=7)  # the Work is dropped at once
            del target
            gc.collect()
            kept = alive() is not None
            group.barrier()
            return kept
        group.barrier()
        if group.rank == 1:
            group.send(torch.arange(64.0), 0, tag=7)
    return None


def run_use_after_shutdown(b):
    other = MPICommunicationBackend(b.comm)
    other.shutdown()
    other.shutdown()  # idempotent
    for call in (lambda: other.all_reduce(torch.ones(1)), lambda: other.send(torch.ones(1), 0),
                 lambda: other.barrier()):
        with pytest.raises(ValueError, match="after shutdown"):
            call()
    return other.is_shut_down


def run_init_backend(b):
    from mpi4py import MPI
    with init_backend("auto", timeout=30) as auto:
        t = torch.tensor([1.0])
        auto.all_reduce(t)
        return type(auto).__name__, auto.rank == MPI.COMM_WORLD.Get_rank(), auto.world_size, t.item()


def raise_on_rank_one(b):
    b.barrier()
    if b.rank == 1:
        raise KeyError("rank one gives up")
    return b.rank


def die_on_rank_one(b):
    if b.rank == 1:
        os._exit(3)
    b.barrier()  # the others wait for rank 1 in a collective


def ranks_times_two(b):
    return 2 * b.rank


# ---- tests ---------------------------------------------------------------------------------------
def test_timeout_names_the_missing_rank_and_sequence_number(pool3):
    start = time.monotonic()
    results = pool3.run(run_timeout, 2)
    assert time.monotonic() - start < 20
    assert results[2] == "skipped"
    for (name, missing, seq, message), elapsed in results[:2]:
        assert name == "CollectiveTimeoutError"
        assert missing == [2] and seq == 2, message
        assert "all_reduce (sequence number 2)" in message and "[2]" in message
        assert 0.9 < elapsed < 10
    assert pool3.run(ranks_times_two) == [0, 2, 4]  # the job itself is still usable


def test_a_rank_late_for_new_group_times_out_too(pool3):
    # It used to hang in Comm.Split: the others' abandoned Ibarrier completed its own.
    for name, elapsed in pool3.run(run_late_new_group)[:2]:
        assert name == "CollectiveTimeoutError" and elapsed < 10
    assert pool3.run(ranks_times_two) == [0, 2, 4]


def test_a_rank_late_for_a_call_its_peers_gave_up_on_stops_at_once_naming_the_same_call(pool3):
    # The late rank's all_reduce used to complete against the abandoned request of a rank
    # that had raised, as if nothing were wrong.
    check_late_for_a_call(pool3.run(run_late_for_a_call))
    assert pool3.run(ranks_times_two) == [0, 2, 4]


def test_recv_timeout_names_the_sender(pool3):
    name, missing, seq, message = pool3.run(run_recv_timeout)[0]
    assert name == "CollectiveTimeoutError" and missing == [1] and seq == 1
    assert "tag 5" in message


@pytest.mark.parametrize("kind", ["shape", "dtype", "op"])
def test_debug_mismatch_raises_on_every_rank(pool3, kind):
    for name, _, seq, message in pool3.run(run_mismatch, kind):
        assert name == "CollectiveMismatchError" and seq == 2, message
        assert "rank 2 called" in message


@pytest.mark.parametrize("received", [5, 3])
def test_recv_of_another_size_is_a_mismatch(pool3, received):
    name, _, _, message = pool3.run(run_p2p_mismatch, received)[1]
    assert name == "CollectiveMismatchError"
    assert "rank 0 sent" in message and f"({received * 4} bytes)" in message


@pytest.mark.parametrize("received, sent", [(5, "sent 16 bytes"), (3, "sent more than 12 bytes")])
def test_polling_a_recv_of_another_size_completes_and_the_wait_names_the_mismatch(pool3, received, sent):
    # is_completed() raised the mismatch itself, and for a larger message MPI's raw "Message
    # truncated" error stack, after which wait() said the sender had sent 0 bytes.
    raised, completed, first, second = pool3.run(run_p2p_mismatch_polled, received)[1]
    assert raised is None and completed
    for name, _, seq, message in (first, second):
        assert name == "CollectiveMismatchError" and seq == 1, message
        assert f"rank 0 {sent} with tag 3" in message and f"({received * 4} bytes)" in message, message


def test_shutdown_frees_the_communicator_once_an_expired_wait_has_completed(pool3):
    # The expired wait kept its request among the timed-out ones for good, so shutdown never
    # freed the communicator: one leaked per such group (MPICH has a few thousand context ids).
    freed = pool3.run(run_recv_wait_expires_then_completes)
    assert freed == [(True, [1.0, 2.0, 3.0]), (True, [0.0] * 3), (True, [0.0] * 3)]


def test_a_dropped_receive_keeps_its_buffer_until_it_completes(pool3):
    # The buffer was freed with the Work while MPI still had the receive posted: the message
    # then landed in freed memory (whatever the allocator had put there since).
    assert pool3.run(run_dropped_recv) == [True, None, None]
    assert pool3.run(ranks_times_two) == [0, 2, 4]


def test_use_after_shutdown_raises_value_error(pool3):
    assert pool3.run(run_use_after_shutdown) == [True] * 3


def test_init_backend_auto_under_mpiexec(pool3):
    assert pool3.run(run_init_backend) == [("MPICommunicationBackend", True, 3, 3.0)] * 3


def test_raising_rank_is_reraised_with_its_rank_named(pool3):
    with pytest.raises(KeyError, match="rank one gives up") as info:
        pool3.run(raise_on_rank_one)
    assert any("raised on rank 1" in note for note in info.value.__notes__)
    assert pool3.run(ranks_times_two) == [0, 2, 4]


def test_pool_restarts_the_job_after_a_rank_dies(pool3):
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1") as info:
        pool3.run(die_on_rank_one)
    assert info.value.failed_rank == 1 and time.monotonic() - start < 30
    assert pool3.run(ranks_times_two) == [0, 2, 4]


@pytest.mark.parametrize("wrap", ["function", "partial", "nested partial", "argument"])
def test_what_the_ranks_cannot_import_is_refused_before_anything_runs(pool3, monkeypatch, wrap):
    """The ranks run ``python -m distframe._mpi_launch``, so nothing of the caller's ``__main__``
    can be imported there: a function defined in the script, a ``functools.partial`` of one, or an
    argument whose class is defined there is a ConfigError in the caller, not an unpickling error
    on every rank."""
    main = sys.modules["__main__"]
    in_main = types.FunctionType(ranks_times_two.__code__, globals(), "distframe_test_fn")
    in_main.__module__, in_main.__qualname__ = "__main__", in_main.__name__
    kind = type("DistframeTestKind", (), {"__module__": "__main__"})
    monkeypatch.setattr(main, in_main.__name__, in_main, raising=False)  # pickles, as a script's
    monkeypatch.setattr(main, kind.__name__, kind, raising=False)
    fn, args = {"function": (in_main, ()), "partial": (functools.partial(in_main), ()),
                "nested partial": (functools.partial(functools.partial(in_main)), ()),
                "argument": (run_mismatch, (kind(),))}[wrap]
    with pytest.raises(ConfigError, match="defined in the __main__ script"):
        pool3.run(fn, *args)
    assert pool3.run(functools.partial(ranks_times_two)) == [0, 2, 4]


def test_spawn_mpi_returns_results_and_reraises():
    with pytest.raises(KeyError) as info:
        spawn(raise_on_rank_one, 2, backend="mpi", timeout=30)
    assert any("raised on rank 1" in note for note in info.value.__notes__)


def test_spawn_mpi_results_in_rank_order():
    assert spawn_mpi(ranks_times_two, 2, timeout=30) == [0, 2]


def test_missing_mpi4py_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    for build in (lambda: spawn(ranks_times_two, 2, backend="mpi"), lambda: MPIPool(2),
                  lambda: MPICommunicationBackend()):
        with pytest.raises(BackendUnavailableError, match=r"pip install 'distframe\[mpi\]'"):
            build()


def test_host_staging_copies_in_and_back():
    device_tensor = torch.arange(6.0)
    host = stage_in(device_tensor, True)
    assert host.data_ptr() != device_tensor.data_ptr() and torch.equal(host, device_tensor)
    host.mul_(2)
    write_back(device_tensor, host)
    assert device_tensor.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert stage_in(device_tensor, False) is device_tensor
    assert stage_back(host, device_tensor, True).device == device_tensor.device


@pytest.fixture(scope="module")
def pool3():
    with MPIPool(3, timeout=60) as p:
        yield p


def run_same_bytes_other_message(b, debug):
    """Messages of the receive's byte count in another dtype, then another shape, then one that
    matches. What each receive raised, and what the receiving tensor held after it."""
    with MPICommunicationBackend(b.comm, timeout=20, debug=debug) as group:
        if group.rank == 0:
            group.send(torch.tensor([1.0, 2.0, 3.0, 4.0]), 1)
            group.send(torch.arange(6.0).view(2, 3), 1)
            group.send(torch.tensor([5, 6, 7, 8], dtype=torch.int32), 1)
        outcomes = []
        if group.rank == 1:
            for target in (torch.zeros(4, dtype=torch.int32), torch.zeros(3, 2),
                           torch.zeros(4, dtype=torch.int32)):
                outcomes.append((_outcome(lambda: group.recv(target, 0)), target.tolist()))
        group.barrier()
        return outcomes


@pytest.mark.parametrize("debug", [True, False])
def test_a_message_of_the_same_size_in_another_dtype_or_shape_is_named(pool3, debug):
    # Before: the float bits came back as int32 and the (2, 3) message as (3, 2), without a word.
    # Outside debug mode ranks on one node see what was sent through shared memory (mpi_messages).
    (dtype, zeros), (shape, zeros_2d), (fine, received) = pool3.run(run_same_bytes_other_message, debug)[1]
    assert dtype[0] == "CollectiveMismatchError" and dtype[2] == 1, dtype
    assert "dtype=float32" in dtype[3] and "dtype=int32" in dtype[3], dtype
    assert shape[0] == "CollectiveMismatchError" and "shape=(2, 3)" in shape[3] and "(3, 2)" in shape[3]
    if debug:  # the payload went to a buffer of its own
        assert zeros == [0] * 4 and zeros_2d == [[0.0, 0.0]] * 3  # the receive's tensor left as it was
    assert fine is None and received == [5, 6, 7, 8]  # the channel stays in step
