"""Faults on the in-memory engine: mismatch, timeout, a failing rank, use after shutdown, leaks."""
import threading
import time

import pytest
import torch

from distframe import spawn
from distframe.backends import InMemoryCommunicationBackend
from distframe.errors import CollectiveMismatchError, CollectiveTimeoutError, RankFailedError
from tests.backends.late_rank import check_late_for_a_call, late_for_a_call


def _outcomes(fn, world_size, **kw):
    """Runs fn on every rank and returns each rank's exception (or None), without re-raising."""
    def wrapped(b):
        try:
            fn(b)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc
        return None
    return spawn(wrapped, world_size, **kw)


@pytest.mark.parametrize("variant", ["op", "shape", "dtype", "reduce_op", "root"])
def test_mismatch_raises_on_every_rank(variant):
    def fn(b):
        odd = b.rank == 1
        t = torch.zeros(3 if odd and variant == "shape" else 2,
                        dtype=torch.float64 if odd and variant == "dtype" else torch.float32)
        if variant == "op" and odd:
            b.broadcast(t, 0)
        elif variant == "reduce_op":
            b.all_reduce(t, "max" if odd else "sum")
        elif variant == "root":
            b.broadcast(t, 1 if odd else 0)
        else:
            b.all_reduce(t)
    errors = _outcomes(fn, 3, timeout=10)
    assert all(isinstance(e, CollectiveMismatchError) for e in errors), errors
    assert all(e.seq == 1 and "rank 1 called" in str(e) for e in errors)


def test_recv_shape_mismatch():
    def fn(b):
        if b.rank == 0:
            b.send(torch.zeros(3), 1)
        else:
            b.recv(torch.zeros(4), 0)
    errors = _outcomes(fn, 2, timeout=10)
    assert errors[0] is None and isinstance(errors[1], CollectiveMismatchError)
    assert "shape (3,)" in str(errors[1]) and "(4,)" in str(errors[1])


def test_timeout_names_op_sequence_and_missing_ranks():
    # Ranks 1 and 3 stay until the others have timed out: a rank whose function has returned
    # is not waited for (test_a_rank_whose_function_returned_is_not_waited_for).
    everyone_done = threading.Barrier(4)

    def fn(b):
        b.all_reduce(torch.ones(1))  # seq 1, everyone
        try:
            if b.rank not in (1, 3):
                b.all_gather(torch.ones(1))  # seq 2: ranks 1 and 3 never come
        finally:
            everyone_done.wait(10)
    start = time.monotonic()
    errors = _outcomes(fn, 4, timeout=0.5)
    assert time.monotonic() - start < 5
    for r in (0, 2):
        e = errors[r]
        assert isinstance(e, CollectiveTimeoutError)
        assert (e.op, e.seq, e.missing_ranks) == ("all_gather", 2, [1, 3])
        assert "all_gather (sequence number 2)" in str(e) and "[1, 3]" in str(e)
    assert errors[1] is None and errors[3] is None


def test_async_timeout_surfaces_on_wait_naming_the_missing_ranks():
    """The error of an asynchronous call that timed out reaches ``Work.wait()`` as it is, not
    replaced by a 'wait expired' error that has lost the op's missing ranks."""
    def fn(b):
        if b.rank == 0:
            b.all_gather(torch.ones(1), async_op=True).wait()  # rank 1 never comes
    errors = _outcomes(fn, 2, timeout=0.5)
    e = errors[0]
    assert isinstance(e, CollectiveTimeoutError)
    assert (e.op, e.seq, e.missing_ranks) == ("all_gather", 1, [1])
    assert "expired" not in str(e)


def test_timeout_in_subgroup_names_global_ranks():
    everyone_done = threading.Barrier(4)  # as in test_timeout_names_op_sequence_and_missing_ranks

    def fn(b):
        sub = b.new_group([2, 3])
        try:
            if sub is not None and sub.rank == 0:
                sub.barrier()
        finally:
            everyone_done.wait(10)
    errors = _outcomes(fn, 4, timeout=0.3)
    assert isinstance(errors[2], CollectiveTimeoutError)
    assert errors[2].missing_ranks == [1] and "global ranks [3]" in str(errors[2])


def test_recv_timeout_names_the_sender():
    errors = _outcomes(lambda b: b.recv(torch.zeros(1), 1) if b.rank == 0 else None, 2, timeout=0.2)
    assert isinstance(errors[0], CollectiveTimeoutError) and errors[0].missing_ranks == [1]


@pytest.mark.parametrize("call", ["all_reduce", "recv"])
def test_raising_rank_stops_the_others_at_once(call):
    # Receives wait on their own rank's condition: a failure must wake those too, not only the
    # waits of collectives (the once-a-second backstop would end them 1 s later).
    waited = {}

    def fn(b):
        if b.rank == 2:
            time.sleep(0.1)
            raise KeyError("boom on purpose")
        start = time.monotonic()
        try:
            if call == "all_reduce":
                b.all_reduce(torch.ones(4))
            else:
                b.recv(torch.zeros(1), b.rank ^ 1)  # ranks 0 and 1 (and 3 and 2) wait for each other
        finally:
            waited[b.rank] = time.monotonic() - start
    with pytest.raises(KeyError, match="boom on purpose") as info:
        spawn(fn, 4, timeout=60)
    assert any("rank 2" in note for note in info.value.__notes__)
    assert len(waited) == 3 and max(waited.values()) < 0.6, waited


def test_peers_see_rank_failed_error():
    seen = []

    def fn(b):
        if b.rank == 0:
            raise RuntimeError("rank 0 dies")
        try:
            b.barrier()
        except RankFailedError as exc:
            seen.append(exc.failed_rank)
            raise
    with pytest.raises(RuntimeError, match="rank 0 dies"):
        spawn(fn, 3, timeout=60)
    assert seen == [0, 0]


def test_no_threads_leak():
    before = {t.ident for t in threading.enumerate()}

    def fn(b):
        b.all_reduce(torch.ones(8), async_op=True).wait()
        if b.rank == 1:
            raise ValueError("x")
        b.barrier()
    with pytest.raises(ValueError):
        spawn(fn, 3, timeout=30)
    spawn(lambda b: b.all_reduce(torch.ones(2), async_op=True).wait(), 2)
    leftover = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert leftover == []


def test_async_failure_surfaces_on_wait_and_next_call():
    def fn(b):
        if b.rank == 0:
            work = b.all_reduce(torch.ones(2), async_op=True)
            with pytest.raises(CollectiveTimeoutError):
                work.wait()
            return "ok"
        return "absent"
    assert spawn(fn, 2, timeout=0.2) == ["ok", "absent"]


def test_single_rank_backend_needs_no_group():
    b = InMemoryCommunicationBackend(0, 1)
    assert b.all_reduce(torch.tensor([2.0]), "avg").item() == 2.0
    with pytest.raises(ValueError, match="create_group"):
        InMemoryCommunicationBackend(0, 2)
    b.shutdown()
    with pytest.raises(ValueError, match="after shutdown"):
        b.barrier()


def test_spawn_rejects_bad_arguments():
    from distframe.errors import ConfigError
    with pytest.raises(ConfigError, match="unknown backend"):
        spawn(lambda b: None, 2, backend="carrier-pigeon")
    with pytest.raises(ConfigError, match="world_size"):
        spawn(lambda b: None, 0)
    with pytest.raises(ValueError, match="timeout"):
        spawn(lambda b: None, 2, timeout=0)


def test_a_completed_collective_is_not_failed_by_a_later_peer_failure():
    """Rank 1 fails right after a barrier completes; the barrier still returns on rank 0, and rank
    0's next collective reports the failure."""
    import threading as th
    done = th.Event()
    outcome = {}

    def fn(b):
        if b.rank == 1:
            b.barrier()
            raise RuntimeError("after the barrier")
        b.barrier()
        outcome["barrier"] = "returned"
        done.set()
        try:
            b.barrier()
        except RankFailedError as exc:
            outcome["next"] = exc.failed_rank
    with pytest.raises(RuntimeError, match="after the barrier"):
        spawn(fn, 2, timeout=30)
    assert outcome == {"barrier": "returned", "next": 1}


def test_ready_wait_survives_a_failure_but_new_calls_stop():
    """Deterministic form of the above: a wait whose condition already holds returns although a
    peer has failed; a call that starts after the failure raises RankFailedError at once."""
    from distframe.backends.rendezvous import Rendezvous, World
    from distframe.backends.signature import Signature
    world = World()
    rdv = Rendezvous(world, [0, 1])
    world.abort(1, RuntimeError("peer died"))
    with rdv.cond:
        rdv._wait(lambda: True, time.monotonic() + 1, 1.0, "barrier", 1, set)
    with pytest.raises(RankFailedError, match="rank 1"):
        rdv.arrive(0, 1, Signature("barrier"), None, 1.0)


def test_calls_queued_behind_a_failed_async_call_end_before_the_failure_is_reported():
    """An asynchronous call that fails (here a mismatch) ends the calls queued behind it without
    running them: the synchronous call that reports the failure returns with none of them still
    running, so the next call cannot run beside one of them, out of issue order. Rank 1 never
    makes call 2, so a queued call that did run would wait for the whole timeout."""
    from distframe.errors import DistFrameError
    release = threading.Event()

    def fn(b):
        if b.rank == 1:
            with pytest.raises(CollectiveMismatchError):
                b.broadcast(torch.zeros(2), 0)  # call 1; rank 0 makes an all_reduce
            release.wait(60)
            return
        try:
            failed = b.all_reduce(torch.ones(2), async_op=True)  # call 1: a mismatch
            queued = b.all_gather(torch.ones(1), async_op=True)  # call 2: rank 1 never comes
            with pytest.raises(CollectiveMismatchError, match=r"\(sequence number 1\)"):
                b.barrier()  # call 3 reports call 1's failure
            assert queued.is_completed() and failed.is_completed()
            with pytest.raises(DistFrameError, match=r"all_gather \(sequence number 2\) was not run: "
                                                     r"all_reduce \(sequence number 1\).*failed"):
                queued.wait()
        finally:
            release.set()
    spawn(fn, 2, timeout=10)


def test_a_synchronous_call_waits_for_no_second_timeout_after_an_async_one_timed_out():
    """Rank 1 never calls: the first asynchronous call times out, the two queued behind it end at
    once, and the next synchronous call raises the timeout of the first (naming its missing rank)."""
    release = threading.Event()
    outcome = {}

    def fn(b):
        if b.rank == 1:
            release.wait(60)
            return
        try:
            works = [b.all_reduce(torch.ones(1), async_op=True) for _ in range(3)]
            with pytest.raises(CollectiveTimeoutError) as info:
                b.barrier()
            outcome["raised"] = (info.value.op, info.value.seq, info.value.missing_ranks)
            outcome["done"] = [w.is_completed() for w in works]
            for seq, w in enumerate(works[1:], start=2):
                # The failure's class and fields, which launchers and elastic runs act on: a plain
                # DistFrameError here made a ZeRO-3 rank's peer timeout look like its own error.
                with pytest.raises(CollectiveTimeoutError, match=rf"all_reduce \(sequence number {seq}\) "
                                                                 "was not run") as queued:
                    w.wait()
                outcome.setdefault("queued", []).append((queued.value.op, queued.value.seq,
                                                         queued.value.missing_ranks))
        finally:
            release.set()
    spawn(fn, 2, timeout=1.0)
    assert outcome == {"raised": ("all_reduce", 1, [1]), "done": [True, True, True],
                       "queued": [("all_reduce", 1, [1])] * 2}


def test_calls_run_again_once_the_failure_was_seen(monkeypatch):
    """Asynchronous calls issued after a failed one, before a wait saw the failure, are not run;
    those issued after that wait run, and so does a synchronous call."""
    from distframe.errors import DistFrameError
    b = InMemoryCommunicationBackend(0, 1)

    def broken(*args):
        raise RuntimeError("injected failure")
    with monkeypatch.context() as patch:
        patch.setattr(b, "_all_reduce", broken)
        failed = b.all_reduce(torch.ones(1), async_op=True)
        queued = b.all_reduce(torch.ones(1), async_op=True)
        with pytest.raises(RuntimeError, match="injected failure"):
            failed.wait()
    with pytest.raises(RuntimeError, match=r"all_reduce \(sequence number 2\) was not run: all_reduce "
                                           r"\(sequence number 1\).*RuntimeError: injected failure") as info:
        queued.wait()
    assert not isinstance(info.value, DistFrameError)  # the failure's own class
    assert b.all_reduce(torch.ones(1), async_op=True).wait().item() == 1.0
    assert b.all_reduce(torch.ones(1)).item() == 1.0
    assert b.all_gather(torch.ones(1), async_op=True).wait().tolist() == [1.0]
    b.shutdown()


@pytest.mark.parametrize("where", ["all_reduce", "subgroup barrier", "recv"])
def test_a_rank_whose_function_returned_is_not_waited_for(where):
    """Rank 1's function returns without making the call its peers wait in: it can never make
    it, so they stop at once with an error naming it, the op and the sequence number, instead of
    waiting out the timeout (60 s here)."""
    def fn(b):
        sub = b.new_group([0, 1]) if where == "subgroup barrier" else None  # call 1
        if b.rank == 1:
            return "left early"
        if where == "all_reduce":
            b.all_reduce(torch.ones(2))  # call 1
        elif where == "subgroup barrier":
            if sub is not None:
                sub.barrier()
        else:
            b.recv(torch.zeros(2), 1, tag=4)
    with pytest.raises(CollectiveTimeoutError) as info:
        spawn(fn, 3, timeout=60)
    e = info.value
    expected = {"all_reduce": ("all_reduce", 1), "subgroup barrier": ("barrier", 1), "recv": ("recv", 1)}
    assert (e.op, e.seq, e.missing_ranks) == (*expected[where], [1])
    assert "rank 1 returned from the function spawn ran" in str(e)


def test_a_returned_rank_whose_asynchronous_calls_are_still_queued_is_waited_for():
    """Rank 1 returns with two asynchronous calls on a subgroup not yet made (rank 0 joins them
    late): they still run, so the group completes them."""
    def fn(b):
        sub = b.new_group([1, 0])
        if b.rank == 1:
            sub.all_reduce(torch.ones(1), async_op=True)
            sub.all_reduce(torch.full((1,), 2.0), async_op=True)
            return None
        time.sleep(0.3)
        return sub.all_reduce(torch.ones(1)).item(), sub.all_reduce(torch.full((1,), 2.0)).item()
    assert spawn(fn, 2, timeout=60) == [(2.0, 4.0), None]


def test_a_departure_records_the_messages_sent_and_the_receives_posted():
    """Per channel, so that a sender can tell whether a message to a rank that left can still be
    received (distframe/backends/departures.py, [Note: sends to a rank that left])."""
    def fn(b):
        if b.rank == 1:
            b.recv(torch.zeros(1), 0, tag=2)
            b.send(torch.zeros(1), 0, tag=3)
            return None
        b.send(torch.ones(1), 1, tag=2)
        b.send(torch.ones(1), 1, tag=2)  # never received: the send returned anyway (buffered)
        b.recv(torch.zeros(1), 1, tag=3)
        deadline = time.monotonic() + 10
        while 1 not in b.departures() and time.monotonic() < deadline:
            time.sleep(0.01)
        return b.departures().get(1)
    left = spawn(fn, 2, timeout=60)[0]
    assert (left.sent, left.received) == ({(0, 3): 1}, {(0, 2): 1})


@pytest.mark.parametrize("call", ["all_reduce", "reduce", "reduce_scatter"])
@pytest.mark.parametrize("op", ["min", "max"])
def test_min_and_max_of_complex_tensors_are_refused_before_communicating(call, op):
    """Complex numbers have no order. Every rank raises ValueError before any communication (it
    was torch's RuntimeError mid-call, and from reduce on dst only: the other ranks returned),
    and the group goes on working."""
    def fn(b):
        t = torch.ones(2 * b.world_size, dtype=torch.complex128)
        args = {"reduce": (0,)}.get(call, ())
        with pytest.raises(ValueError, match="complex numbers have no order"):
            getattr(b, call)(t, *args, op)
        assert b.stats.total_calls() == 0
        # PRODUCT of complex numbers stays allowed: (1)(1+i)(1+2i) = -1+3i
        return b.all_reduce(torch.full((2,), 1.0 + b.rank * 1j, dtype=torch.complex128), "product")
    for result in spawn(fn, 3, timeout=10):
        torch.testing.assert_close(result, torch.full((2,), -1.0 + 3j, dtype=torch.complex128),
                                   rtol=0, atol=1e-15)


def test_a_rank_late_for_a_call_its_peers_gave_up_on_stops_at_once_naming_the_same_call():
    # It used to wait out its own timeout and then name the peers that had given up as missing
    # (or, once they had returned, say they "never made this call").
    check_late_for_a_call(spawn(late_for_a_call, 3, timeout=1.0))
