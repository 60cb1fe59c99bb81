"""Mismatches caught outside debug mode through the same-node call slots
(``distframe.backends.call_slots``): the slots themselves, then Gloo and MPI ranks that call
different ops, shapes, dtypes or roots, whichever rank arrives first."""
from __future__ import annotations

import mmap
import time

import pytest
import torch

from distframe.backends.call_slots import AREA_BYTES, SLOTS, CallSlots, call_words, describe_words
from distframe.errors import CollectiveMismatchError


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


@pytest.fixture(scope="module")
def mpi_pool():
    pytest.importorskip("mpi4py", reason="the MPI engine needs the [mpi] extra (mpi4py, mpich)")
    from distframe._mpi_launch import MPIPool
    with MPIPool(3, timeout=60) as pool:
        yield pool


@pytest.mark.mpi
@pytest.mark.parametrize("kind, early", MISMATCHES)
def test_mpi_ranks_that_disagree_raise_on_every_rank_outside_debug(mpi_pool, kind, early):
    _check(mpi_pool.run(rank_mismatch_mpi, kind, early), kind)
