"""distframe.backends.objects on the in-memory engine: a blob that is not bytes is a TypeError
naming what was passed on the rank that passed it, and every other rank learns of it (a
RankFailedError naming that rank) instead of waiting in the collective for its timeout."""
from __future__ import annotations

import array

import pytest

from distframe import spawn
from distframe.backends.objects import all_gather_bytes, broadcast_bytes
from distframe.errors import RankFailedError

BAD = ["text", 5, None, [1, 2]]  # (bytearray(5) and bytearray([1, 2]) sent made-up bytes)


def _outcomes(fn, world=3):
    """Each rank's result, or the exception it raised (caught, so every rank reports)."""
    def run(b):
        try:
            return fn(b)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc
    return spawn(run, world, timeout=20)


@pytest.mark.parametrize("bad", BAD, ids=lambda v: type(v).__name__)
def test_all_gather_bytes_of_something_else(bad):
    outcomes = _outcomes(lambda b: all_gather_bytes(b, bad if b.rank == 1 else b"ok"))
    mine = outcomes[1]
    assert isinstance(mine, TypeError), mine
    assert type(bad).__name__ in str(mine) and "bytes" in str(mine) and "encode" in str(mine)
    for rank in (0, 2):
        assert isinstance(outcomes[rank], RankFailedError), outcomes[rank]
        assert outcomes[rank].failed_rank == 1 and "all_gather_bytes" in str(outcomes[rank])


@pytest.mark.parametrize("bad", BAD, ids=lambda v: type(v).__name__)
def test_broadcast_bytes_of_something_else(bad):
    outcomes = _outcomes(lambda b: broadcast_bytes(b, bad if b.rank == 2 else b"", 2))
    assert isinstance(outcomes[2], TypeError) and type(bad).__name__ in str(outcomes[2])
    for rank in (0, 1):
        assert isinstance(outcomes[rank], RankFailedError), outcomes[rank]
        assert outcomes[rank].failed_rank == 2 and "broadcast_bytes" in str(outcomes[rank])


def test_bytes_like_blobs_pass_and_other_ranks_blobs_are_ignored():
    """A memoryview sends its bytes whatever its item format (its len() counts items: a view of
    four-byte ints sent a quarter of its length)."""
    ints = memoryview(array.array("i", [1, 2]))
    outcomes = _outcomes(lambda b: (all_gather_bytes(b, bytearray(b"x" * b.rank)),
                                    broadcast_bytes(b, b"from 0" if b.rank == 0 else None, 0),
                                    broadcast_bytes(b, ints, 1)))
    for gathered, broadcast, viewed in outcomes:
        assert gathered == [b"", b"x", b"xx"] and broadcast == b"from 0"
        assert viewed == ints.tobytes() and len(viewed) == 2 * ints.itemsize
