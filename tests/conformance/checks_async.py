"""Conformance checks of asynchronous work (``async_op=True``): waits with a timeout, and waits
repeated or out of issue order. Each runs on every rank of a group, on any engine."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from distframe.errors import CollectiveTimeoutError


def check_wait_timeout_names_the_missing_ranks(backend) -> None:
    """Rank 0's all_reduce waits with a timeout while the others are held back (by a message
    they wait for, so no sleep decides it): the error names the op and exactly those ranks;
    the work then completes once they arrive, and a second wait returns the same result."""
    n, r = backend.world_size, backend.rank
    mine = torch.tensor([float(r + 1)])
    expected = np.arange(1, n + 1, dtype=np.float32).sum()
    token = torch.zeros(1)
    if r == 0:
        work = backend.all_reduce(mine, async_op=True)
        if n > 1:
            with pytest.raises(CollectiveTimeoutError) as info:
                work.wait(timeout=0.5)
            error = info.value
            if error.op != "all_reduce" or error.missing_ranks != list(range(1, n)):
                raise AssertionError(f"Work.wait(timeout=) named {error.op} and missing ranks "
                                     f"{error.missing_ranks}, expected all_reduce and {list(range(1, n))}")
            for peer in range(1, n):
                backend.send(token, peer)
        if work.wait() is not mine or work.wait() is not mine:
            raise AssertionError("Work.wait() must return the reduced tensor, every time it is called")
    else:
        backend.recv(token, 0)
        backend.all_reduce(mine)
    np.testing.assert_array_equal(mine.numpy(), [expected])


def check_waits_out_of_order_and_twice(backend) -> None:
    n, r = backend.world_size, backend.rank
    first = backend.all_gather(torch.tensor([float(r)]), async_op=True)
    second = backend.all_reduce(torch.full((3,), float(r)), async_op=True)
    third = backend.broadcast(torch.tensor([float(r)]), n - 1, async_op=True)
    assert third.wait().tolist() == [float(n - 1)]
    assert second.wait().tolist() == [float(np.arange(n).sum())] * 3
    assert first.wait().tolist() == first.wait().tolist() == list(map(float, range(n)))


def check_receive_wait_timeout_leaves_the_receive_posted(backend) -> None:
    """Rank 0's receive from rank 1 waits with a timeout before rank 1 sends (rank 1 first waits
    for rank 0's go-ahead): the error names recv and rank 1; the receive stays posted, the next
    wait gets the message, and the group still works (on Gloo the expired wait used to close the
    connection to rank 1, so every later call with it failed)."""
    n, r = backend.world_size, backend.rank
    payload = np.arange(3, dtype=np.float32) + 7
    if r == 0 and n > 1:
        got = torch.zeros(3)
        work = backend.irecv(got, 1)
        with pytest.raises(CollectiveTimeoutError) as info:
            work.wait(timeout=0.5)
        if info.value.op != "recv" or info.value.missing_ranks != [1]:
            raise AssertionError(f"an expired receive named {info.value.op} and {info.value.missing_ranks}")
        backend.send(torch.ones(1), 1)
        if work.wait() is not got or work.wait() is not got:
            raise AssertionError("Work.wait() of a receive must return its tensor, every time")
        np.testing.assert_array_equal(got.numpy(), payload)
    elif r == 1:
        backend.recv(torch.zeros(1), 0)
        backend.send(torch.from_numpy(payload), 0)
    total = backend.all_reduce(torch.tensor([float(r)]))
    np.testing.assert_array_equal(total.numpy(), [np.arange(n).sum()])


def make_a_call_the_others_do_not(backend, wait: bool) -> str:
    """Rank 0 issues an asynchronous all_reduce that no other rank makes, then returns; with
    ``wait`` it waits for it first and handles the error itself."""
    if backend.rank == 0:
        work = backend.all_reduce(torch.ones(1), async_op=True)
        if wait and backend.world_size > 1:
            with pytest.raises(CollectiveTimeoutError):
                work.wait()
            return "seen"
    return "returned"


def check_polled_receive_completes(backend) -> None:
    """Rank 0 posts a receive from the last rank and polls ``is_completed()`` (no wait) until it
    is True, as a loop that overlaps work with communication does; then ``wait()`` returns the
    message. On Gloo ``is_completed()`` of a receive stayed False for good (Gloo's work says it
    has completed only to a wait), so such a loop never ended; the deadline here stands in for it."""
    n, r = backend.world_size, backend.rank
    payload = np.arange(5, dtype=np.float32) - 2
    if r == 0 and n > 1:
        got = torch.zeros(5)
        work = backend.irecv(got, n - 1, tag=3)
        deadline = time.monotonic() + 10.0
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise AssertionError(f"{backend.engine}: is_completed() of a receive whose message "
                                     "was sent stayed False for 10 s")
            time.sleep(0.001)
        # True means the message is in the tensor, as MPI and Gloo have it (the in-memory engine
        # copied it only in wait(): a loop that read the tensor after polling saw zeros).
        np.testing.assert_array_equal(got.numpy(), payload)
        if not work.is_completed() or work.wait() is not got:
            raise AssertionError("a completed receive must stay completed and wait() return its tensor")
        np.testing.assert_array_equal(got.numpy(), payload)
    elif r == n - 1 and n > 1:
        backend.send(torch.from_numpy(payload), 0, tag=3)
    backend.barrier()


def check_a_wait_timeout_that_is_not_seconds_says_so(backend, receive: bool) -> None:
    """``Work.wait(timeout="1")`` (or True) is a ValueError saying what to pass, and leaves the
    work to a later wait; a string gave a bare TypeError from a comparison inside the engine."""
    n, r = backend.world_size, backend.rank
    if receive:
        if n == 1:
            return
        if r == 0:
            backend.send(torch.ones(2), 1, tag=6)
        if r != 1:
            return
        work, expected = backend.irecv(torch.zeros(2), 0, tag=6), torch.ones(2)
    else:
        work, expected = backend.all_reduce(torch.ones(2), async_op=True), torch.full((2,), float(n))
    for bad in ("1", True, -1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout must be None .* or a number of seconds"):
            work.wait(timeout=bad)
    torch.testing.assert_close(work.wait(), expected, rtol=0, atol=0)
