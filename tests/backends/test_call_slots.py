"""Mismatches caught outside debug mode through the same-node call slots
(``distframe.backends.call_slots``): the slots themselves, then Gloo and MPI ranks that call
different ops, shapes, dtypes or roots, whichever rank arrives first."""
from __future__ import annotations

import mmap
import time

import pytest
import torch

from distframe.backends.call_slots import AREA_BYTES, SLOTS, CallSlots, call_words, describe_words
from distframe.errors import CollectiveMismatchError, CollectiveTimeoutError
from tests.backends.mpi_pools import mpi_pool_fixture


# ---- the slots, in one process --------------------------------------------------------------------
def _pair():
    maps = [mmap.mmap(-1, AREA_BYTES) for _ in range(2)]
    return CallSlots(maps[0], {1: maps[1]}, 0), CallSlots(maps[1], {0: maps[0]}, 1), maps


def test_agreeing_calls_pass_and_a_differing_one_raises_on_the_later_rank_and_the_earlier():
    a, b, _ = _pair()
    a.announce("all_reduce", 1, (4,), torch.float32, (("op", "SUM"),))
    b.announce("all_reduce", 1, torch.Size([4]), torch.float32, (("op", "SUM"),))
    a.announce("all_reduce", 2, (4,), torch.float32, (("op", "SUM"),))
    with pytest.raises(CollectiveMismatchError, match=r"sequence number 2") as later:
        b.announce("all_reduce", 2, (4,), torch.int32, (("op", "SUM"),))
    earlier = a.error("all_reduce", 2)  # what the rank that arrived first finds while it waits
    for text in (str(later.value), str(earlier)):
        assert "rank 0 called all_reduce(shape=(4,), dtype=float32, op=SUM)" in text, text
        assert "rank 1 called all_reduce(shape=(4,), dtype=int32, op=SUM)" in text, text
    assert a.error("all_reduce", 1) is None  # only the call this rank announced last is asked about


@pytest.mark.parametrize("theirs, shown", [
    (("all_gather", (4,), torch.float32, ()), "all_gather(shape=(4,), dtype=float32)"),
    (("all_reduce", (2, 2), torch.float32, (("op", "SUM"),)), "shape=(2, 2)"),
    (("all_reduce", (4,), torch.float32, (("op", "MAX"),)), "op=MAX"),
    (("broadcast", (4,), torch.float32, (("src", 1),)), "broadcast(shape=(4,), dtype=float32, src=1)"),
    (("all_reduce", (1, 1, 1, 1, 4), torch.float32, (("op", "SUM"),)), "shape=(1, 1, 1, 1, ...)"),
])
def test_each_part_of_a_call_is_compared_and_named(theirs, shown):
    a, b, _ = _pair()
    a.announce("all_reduce", 1, (4,), torch.float32, (("op", "SUM"),))
    with pytest.raises(CollectiveMismatchError) as info:
        b.announce(theirs[0], 1, *theirs[1:])
    assert f"rank 1 called {theirs[0]}" in str(info.value) and shown in str(info.value)


@pytest.mark.parametrize("missing", [[1], [0, 62, 63, 200], [], None, [400]])
def test_a_call_given_up_on_names_the_same_call_and_missing_ranks_on_the_peers(missing):
    a, b, _ = _pair()
    a.announce("all_reduce", 5, (4,), torch.float32, ())
    a.give_up("all_reduce", 5, missing, 1.5)
    b.announce("barrier", 4, None, None, ())  # earlier calls are not affected
    with pytest.raises(CollectiveTimeoutError) as late:
        b.announce("all_reduce", 5, (4,), torch.float32, ())  # refused before it is issued
    expected = None if missing == [400] else missing  # past the mark's bits: unknown
    error = late.value
    assert (error.op, error.seq, error.missing_ranks, error.timeout) == ("all_reduce", 5, expected, 1.5)
    assert "rank 0 gave up on this call" in str(error) and "stopped at once" in str(error)
    for slots, who, named in ((a, "this rank", missing), (b, "rank 0", expected)):  # every later
        with pytest.raises(CollectiveTimeoutError) as refused:            # call is refused
            slots.announce("all_gather", 7, (2,), torch.float32, ())
        assert refused.value.seq == 5 and refused.value.missing_ranks == named
        assert f"{who} gave up on this call" in str(refused.value)
        assert "all_gather (sequence number 7) was not issued" in str(refused.value)


def test_a_peer_waiting_in_the_call_finds_that_it_was_given_up_on():
    a, b, _ = _pair()
    a.announce("broadcast", 3, (2,), torch.float32, (("src", 0),))
    b.announce("broadcast", 3, (2,), torch.float32, (("src", 0),))
    assert b.error("broadcast", 3) is None
    a.give_up("broadcast", 3, [2], 0.5)
    error = b.error("broadcast", 3)
    assert isinstance(error, CollectiveTimeoutError) and error.missing_ranks == [2], error


def test_shapes_that_differ_only_past_the_stored_dims_differ():
    assert call_words("all_reduce", (1, 1, 1, 1, 4), torch.float32, ()) != \
        call_words("all_reduce", (1, 1, 1, 1, 5), torch.float32, ())


def test_a_peer_not_yet_there_or_a_full_ring_ahead_goes_unchecked():
    a, b, _ = _pair()
    b.announce("all_reduce", 3, (4,), torch.float32, ())  # rank 0 has not arrived
    assert b.error("all_reduce", 3) is None
    a.announce("barrier", 3 + SLOTS, None, None, ())  # rank 0 is a whole ring ahead: slot reused
    assert b.error("all_reduce", 3) is None


def test_a_slot_being_rewritten_is_skipped():
    a, b, maps = _pair()
    a.announce("all_reduce", 5, (4,), torch.float32, ())
    b.announce("all_reduce", 5, (4,), torch.float32, ())
    maps[0][5 * 128 + 8:5 * 128 + 16] = (99).to_bytes(8, "little", signed=True)  # a field changes
    assert b.error("all_reduce", 5) is not None
    maps[0][5 * 128:5 * 128 + 8] = (-1).to_bytes(8, "little", signed=True)  # as a writer marks it
    assert b.error("all_reduce", 5) is None


def test_descriptions_of_calls_without_shape_or_with_unhashable_arguments():
    assert describe_words(call_words("scatter", None, None, (("src", 0),))) == "scatter(src=0)"
    words = call_words("new_group", (2,), None, (("ranks", [0, 2]),))
    assert words == call_words("new_group", (2,), None, (("ranks", [0, 2]),))
    assert words != call_words("new_group", (2,), None, (("ranks", [0, 1]),))



@pytest.mark.parametrize("ahead", [1, 2])
def test_a_rank_that_raced_past_a_mismatch_learns_of_it_at_its_next_call_or_wait(ahead):
    a, b, _ = _pair()
    a.announce("broadcast", 1, (4,), torch.float32, (("src", 0),))  # completed at once: never asked
    for seq in range(2, 2 + ahead - 1):  # and so did more calls (a root's eager broadcasts)
        a.announce("broadcast", seq, (4,), torch.float32, (("src", 0),))
    a.announce("all_reduce", 1 + ahead, (2,), torch.float32, (("op", "SUM"),))  # issued; it waits
    with pytest.raises(CollectiveMismatchError, match=r"broadcast \(sequence number 1\)"):
        b.announce("broadcast", 1, (5,), torch.float32, (("src", 0),))
    waiting = a.error("all_reduce", 1 + ahead)  # what a's wait now finds, naming call 1
    assert (waiting.op, waiting.seq) == ("broadcast", 1), waiting
    assert "shape=(5,)" in str(waiting) and f"this rank at all_reduce, sequence number {1 + ahead}" in \
        str(waiting), waiting
    for rank in (a, b):  # neither issues anything more: each call raises the first mismatch
        with pytest.raises(CollectiveMismatchError, match=r"broadcast \(sequence number 1\).*was not issued"):
            rank.announce("barrier", 2 + ahead, None, None, ())


def test_a_rank_that_finds_a_mismatch_while_it_waits_refuses_its_next_call():
    a, b, _ = _pair()
    a.announce("all_reduce", 1, (4,), torch.float32, ())
    b.announce("all_reduce", 1, (4,), torch.float32, ())
    a.announce("all_reduce", 2, (4,), torch.float32, ())  # completed, then b came
    b.announce("all_reduce", 2, (4,), torch.float32, ())
    b.announce("all_gather", 3, (4,), torch.float32, ())  # b issued first; a disagrees, and raises
    with pytest.raises(CollectiveMismatchError):
        a.announce("all_reduce", 3, (4,), torch.float32, ())
    assert b.error("all_gather", 3) is not None and b.mismatch[:2] == ("all_gather", 3)
    with pytest.raises(CollectiveMismatchError, match=r"all_gather \(sequence number 3\)"):
        b.announce("all_reduce", 4, (4,), torch.float32, ())


def test_the_sent_message_table_names_only_the_message_a_receive_asks_about():
    from distframe.backends.mpi_messages import AREA_BYTES as SENT_BYTES
    from distframe.backends.mpi_messages import ENTRIES, SentMessages
    maps = [mmap.mmap(-1, SENT_BYTES) for _ in range(2)]
    sender, receiver = SentMessages(maps[0], {1: maps[1]}, 0, 0), SentMessages(maps[1], {0: maps[0]}, 1, 0)
    sender.record(1, 3, 1, torch.ones(2, 3))
    assert receiver.sent_otherwise(0, 3, 1, torch.ones(2, 3)) is None
    assert receiver.sent_otherwise(0, 3, 1, torch.ones(3, 2)) == "send(shape=(2, 3), dtype=float32)"
    assert receiver.sent_otherwise(0, 3, 1, torch.ones(6, dtype=torch.int32)) is not None
    assert receiver.sent_otherwise(0, 4, 1, torch.ones(3, 2)) is None  # another tag: not described
    assert receiver.sent_otherwise(0, 3, 2, torch.ones(3, 2)) is None  # a message not yet sent
    for seq in range(2, 2 + 4 * ENTRIES):  # later messages overwrite the entry: unchecked, not wrong
        sender.record(1, 3, seq, torch.ones(4))
    assert receiver.sent_otherwise(0, 3, 1, torch.ones(3, 2)) is None

# ---- across processes -----------------------------------------------------------------------------
def _call(b, kind, odd):
    """Rank 1 (``odd``) calls something else than ranks 0 and 2; "agree" kinds match."""
    t = torch.ones(6)
    if kind == "shape":  # Gloo ended the process here ("Received data size doesn't match")
        return b.all_reduce(torch.ones(5) if odd else t)
    if kind == "dtype":  # the same bytes: both ranks got bit patterns
        return b.all_reduce(t.int() if odd else t)
    if kind == "op":
        return b.all_gather(t) if odd else b.all_reduce(t)
    if kind == "gather":
        return b.all_gather(torch.ones(3) if odd else t)
    if kind == "scatter":
        return b.reduce_scatter(torch.ones(3) if odd else t)
    if kind == "root":  # the general path
        return b.broadcast(t, src=1 if odd else 0)
    if kind == "async":
        return b.all_reduce(torch.ones(5) if odd else t, async_op=True).wait()
    if kind == "agree-strided":  # one rank on the post-first path, the other on the general one
        return b.all_reduce(torch.ones(6, 2)[:, 0] if odd else t)
    assert kind == "agree-scalar"
    return b.all_gather(torch.tensor(1.0))


def _outcome(b, kind, early):
    """Runs the call with rank ``early`` first (the others 0.3 s later); what each rank raised."""
    if b.rank != early:
        time.sleep(0.3)
    start = time.monotonic()
    try:
        _call(b, kind, b.rank == 1)
    except CollectiveMismatchError as exc:
        return "mismatch", exc.seq, str(exc), time.monotonic() - start
    return "no error", None, "", time.monotonic() - start


def rank_mismatch_gloo(b, kind, early):
    return _outcome(b, kind, early)


def rank_mismatch_mpi(b, kind, early):
    from distframe.backends.mpi import MPICommunicationBackend
    with MPICommunicationBackend(b.comm, timeout=20) as group:  # left unusable: not the pool's
        group.barrier()
        return _outcome(group, kind, early)


def _check(outcomes, kind):
    if kind.startswith("agree"):
        assert [o[0] for o in outcomes] == ["no error"] * 3
        return
    assert [o[0] for o in outcomes] == ["mismatch"] * 3, outcomes
    assert len({o[1] for o in outcomes}) == 1
    for _, _, text, elapsed in outcomes:
        assert "rank 1 called" in text and "shut it down" in text, text
        assert elapsed < PROMPT, (elapsed, text)  # not at the timeout (30 s)


PROMPT = 10.0  # seconds: an error that came sooner was not the timeout's
MISMATCHES = [("shape", 1), ("shape", 0), ("dtype", 1), ("op", 0), ("gather", 1), ("scatter", 1),
              ("root", 1), ("async", 1), ("agree-strided", 0), ("agree-scalar", 0)]


@pytest.fixture(scope="module")
def gloo_pool():
    from distframe._process_launch import ProcessPool
    with ProcessPool(3, "gloo", timeout=30) as pool:
        yield pool


@pytest.mark.gloo
@pytest.mark.parametrize("kind, early", MISMATCHES)
def test_gloo_ranks_that_disagree_raise_on_every_rank_outside_debug(gloo_pool, kind, early):
    _check(gloo_pool.run(rank_mismatch_gloo, kind, early), kind)


mpi_pool = mpi_pool_fixture(3, timeout=60)


@pytest.mark.mpi
@pytest.mark.parametrize("kind, early", MISMATCHES)
def test_mpi_ranks_that_disagree_raise_on_every_rank_outside_debug(mpi_pool, kind, early):
    _check(mpi_pool.run(rank_mismatch_mpi, kind, early), kind)


# ---- a mismatch that some ranks never waited for --------------------------------------------------
def _disagreeing_first_call(b, kind):
    """The call that ranks disagree on: rank 1 (or, for a reduce, rank 2) passes something else."""
    n, t = b.world_size, torch.full((4,), float(b.rank))
    if kind == "broadcast-shape":  # the repro: ranks 0 and 2 returned, then hung in all_reduce
        return b.broadcast(torch.ones(5) if b.rank == 1 else t, 0)
    if kind == "broadcast-src":
        return b.broadcast(t, 1 if b.rank == 1 else 0)
    if kind == "scatter-src":
        src = 0 if b.rank == 0 else 1
        return b.scatter([torch.ones(2)] * n if b.rank == src else None, src)
    assert kind == "reduce-shape"  # a non-root disagrees; the root arrives late
    return b.reduce(torch.ones(5) if b.rank == 2 else t, 0)


def _late_outcome(b, kind, late):
    """Rank ``late`` arrives 0.5 s after the others at a call they disagree on, then every rank
    calls all_reduce: what each call raised on this rank, and how long it took."""
    if b.rank == late:
        time.sleep(0.5)
    outcomes = []
    for call in (lambda: _disagreeing_first_call(b, kind), lambda: b.all_reduce(torch.ones(2))):
        start = time.monotonic()
        try:
            call()
            outcomes.append(("returned", None, None, "", time.monotonic() - start))
        except Exception as exc:  # noqa: BLE001 - reported: every rank's outcome is checked
            outcomes.append((type(exc).__name__, getattr(exc, "op", None), getattr(exc, "seq", None),
                             str(exc), time.monotonic() - start))
    return outcomes


def rank_late_mismatch_gloo(b, kind, late):
    return _late_outcome(b, kind, late), b.has_failed


def rank_late_mismatch_mpi(b, kind, late):
    from distframe.backends.mpi import MPICommunicationBackend
    with MPICommunicationBackend(b.comm, timeout=20) as group:  # left unusable: not the pool's
        group.barrier()
        return _late_outcome(group, kind, late), True


def _check_late(results, kind):
    op = kind.split("-")[0]
    for rank, (outcomes, failed) in enumerate(results):
        first, second = outcomes
        raised = [o for o in outcomes if o[0] != "returned"]
        assert raised and all(o[0] == "CollectiveMismatchError" for o in raised), (rank, outcomes)
        # Named after the call the ranks disagreed on (the group's first: sequence number 2
        # after the MPI group's barrier, 1 or more on the pool's Gloo group).
        assert {(o[1], o[2]) for o in raised} == {(op, results[0][0][-1][2])}, (rank, outcomes)
        assert second[0] == "CollectiveMismatchError", (rank, outcomes)  # the group is unusable
        assert all(o[-1] < PROMPT for o in outcomes), (rank, outcomes)  # not the timeout's
        assert failed, rank  # the pool starts fresh workers


LATE_MISMATCHES = [("broadcast-shape", 1), ("broadcast-src", 1), ("broadcast-src", 0),
                   ("scatter-src", 1), ("scatter-src", 0), ("reduce-shape", 0)]


@pytest.mark.gloo
@pytest.mark.parametrize("kind, late", LATE_MISMATCHES)
def test_gloo_a_mismatch_surfaces_on_every_rank_even_one_whose_part_completed(gloo_pool, kind, late):
    _check_late(gloo_pool.run(rank_late_mismatch_gloo, kind, late), kind)


@pytest.mark.mpi
@pytest.mark.parametrize("kind, late", LATE_MISMATCHES)
def test_mpi_a_mismatch_surfaces_on_every_rank_even_one_whose_part_completed(mpi_pool, kind, late):
    _check_late(mpi_pool.run(rank_late_mismatch_mpi, kind, late), kind)


def rank_new_group_mismatch(b, early):
    """Rank 0 passes [0, 1], the others [0, 1, 2]; rank ``early`` arrives 0.3 s before them."""
    if b.rank != early:
        time.sleep(0.3)
    start = time.monotonic()
    try:
        b.new_group([0, 1] if b.rank == 0 else [0, 1, 2])
    except Exception as exc:  # noqa: BLE001 - reported: every rank's outcome is checked
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "returned", "", time.monotonic() - start


@pytest.mark.gloo
@pytest.mark.parametrize("early", [2, 0])
def test_gloo_new_group_with_different_rank_lists_raises_on_every_rank(gloo_pool, early):
    # Before: the member waiting in the store for the others (they had raised) timed out, saying
    # that ranks 0 and 1 never entered new_group.
    for name, text, elapsed in gloo_pool.run(rank_new_group_mismatch, early):
        assert name == "CollectiveMismatchError", (name, text)
        assert "new_group(shape=(2,)" in text and "new_group(shape=(3,)" in text, text
        assert elapsed < PROMPT, (elapsed, text)
