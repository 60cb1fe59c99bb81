"""A rank late for a call its peers have given up on, as every engine's fault tests run it
(importable: the Gloo and MPI pools pickle the function by reference)."""
from __future__ import annotations

import time

import torch

from distframe.errors import CollectiveTimeoutError

# Seconds after the barrier at which ranks 0, 1 and 2 enter the group's second call. With a
# timeout of 1 s, rank 0 gives up at 1.0 while rank 1 (deadline 1.6: room for Gloo's 0.2 s slices
# on a loaded machine) still waits, and rank 2 comes after both: the ranks that gave up stay
# alive, so no departure explains anything.
ENTER = (0.0, 0.6, 2.5)
STAY_UNTIL = 3.3


def _outcome(call):
    start = time.monotonic()
    try:
        call()
    except CollectiveTimeoutError as exc:
        return exc.op, exc.seq, exc.missing_ranks, round(time.monotonic() - start, 2), str(exc)
    return "completed"


def late_for_a_call(b):
    """World 3, timeout 1 s: each rank's outcome of the second call (an all_reduce that rank 2
    comes to after ranks 0 and 1 have given up on it) and of a third call (an all_gather) made
    right after it."""
    b.barrier()
    start = time.monotonic()
    time.sleep(ENTER[b.rank])
    first = _outcome(lambda: b.all_reduce(torch.ones(3)))
    then = _outcome(lambda: b.all_gather(torch.ones(2)))
    time.sleep(max(0.0, start + STAY_UNTIL - time.monotonic()))
    return first, then


def check_late_for_a_call(results) -> None:
    """Every rank names the same call, its sequence number and the rank that did not arrive in
    time: rank 0 at its timeout, rank 1 as soon as rank 0 gave up (before its own timeout),
    rank 2 at once on arrival; the next call is refused at once, naming the call given up on."""
    for rank, (first, then) in enumerate(results):
        assert first != "completed", (rank, results)
        op, seq, missing, elapsed, text = first
        assert (op, seq, missing) == ("all_reduce", 2, [2]), (rank, text)
        if rank == 1:
            assert "rank 0 gave up on this call" in text, text
        if rank == 2:
            assert "gave up on this call" in text and elapsed < 0.6, (elapsed, text)
        assert then != "completed", (rank, results)
        op, seq, missing, elapsed, text = then
        assert (op, seq, missing) == ("all_reduce", 2, [2]), (rank, text)
        assert "all_gather (sequence number 3) was not issued" in text and elapsed < 0.6, (elapsed, text)
