"""Gloo's buffered sends: ``send`` returns once its payload is copied, and a Gloo send reports
completion only to a wait, so the engine must itself let go of what was received (before its
SendWaiter, every payload a rank sent stayed in memory until shutdown: a pipeline's activations,
async SGD's gradients, each step)."""
from __future__ import annotations

import math
import os
import time
import warnings

import pytest
import torch

from distframe._process_launch import ProcessPool
from distframe.errors import CollectiveTimeoutError

pytestmark = pytest.mark.gloo


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(3, "gloo", timeout=60) as pool:
        yield pool


def held_sends(b) -> int:
    """How many sent payloads the engine still holds (its own bookkeeping, read to see that it
    lets go of what was received)."""
    return b._sends.held()


def rank_sends_released(b, messages):
    right, left = (b.rank + 1) % b.world_size, (b.rank - 1) % b.world_size
    for i in range(messages):
        b.send(torch.full((1000,), float(i)), right, tag=7)
        b.recv(torch.empty(1000), left, tag=7)
    b.barrier()  # every message has been received
    deadline = time.monotonic() + 30
    while held_sends(b) and time.monotonic() < deadline:
        time.sleep(0.01)
    return held_sends(b)


def test_received_sends_are_let_go(pool):
    assert pool.run(rank_sends_released, 40) == [0, 0, 0]



# ---- a message whose shape or dtype differs from the receive's ------------------------------------
# The (shape, dtype) of the messages rank 0 sends, then of rank 1's one receive, without debug=True.
# Before the fingerprint in the tag ([Note: the message's shape in its tag]), "smaller" ended the
# receiving process and the others filled the receive with the wrong values without a word; with
# a fingerprint of the shape alone, the last case's receive took the second message.
MISMATCHES = {
    "smaller": ([((5,), torch.float32)], ((3,), torch.float32)),
    "larger": ([((3,), torch.float32)], ((5,), torch.float32)),
    "same bytes, other dtype": ([((4,), torch.float32)], ((2,), torch.float64)),
    "same numel, other shape": ([((2, 3), torch.float32)], ((3, 2), torch.float32)),
    "another shape, then the receive's": ([((4,), torch.float32), ((3,), torch.float32)],
                                          ((3,), torch.float32)),
}
MISMATCH_TIMEOUT = 4.0


def fresh_group(b, name: str, timeout: float):
    """A group of the pool's processes of its own (store prefix ``name``, own progress board), so
    that the timeout of a mismatched receive leaves the pool's group, and its workers, usable."""
    from distframe.backends import GlooCommunicationBackend
    return GlooCommunicationBackend(b.rank, b.world_size, b._shared.store, timeout=timeout,
                                    prefix=f"test-gloo-sends/{name}", **b._sibling_kwargs())


def rank_mismatched_receive(b, case: str, name: str, sender_gone_first: bool = False):
    """``sender_gone_first``: the receive is posted only after the sender has shut its group down
    (Gloo then reports the connection closed; under load it happened by chance)."""
    sent, (shape, dtype) = MISMATCHES[case]
    # The sender's shutdown waits for its unreceived send up to the timeout, then drops it.
    sub = fresh_group(b, name, 1.0 if sender_gone_first else MISMATCH_TIMEOUT)
    try:
        if sub.rank == 0:
            for sent_shape, sent_dtype in sent:
                sub.send(torch.ones(sent_shape, dtype=sent_dtype), 1, tag=5)
            return "sent"
        if sub.rank == 1:
            if sender_gone_first:
                b.barrier()
            try:
                received = sub.recv(torch.zeros(shape, dtype=dtype), 0, tag=5)
            except CollectiveTimeoutError as exc:
                return exc.op, exc.seq, exc.missing_ranks, str(exc)
            return f"received {received.tolist()}"
        return None
    finally:
        with warnings.catch_warnings():  # the sender's shutdown may drop the unreceived message
            warnings.simplefilter("ignore", RuntimeWarning)
            sub.shutdown()
        if sender_gone_first and b.rank != 1:
            b.barrier()


def rank_pid(b):
    b.barrier()
    return os.getpid()


@pytest.mark.parametrize("sender_gone_first", [False, True])
@pytest.mark.parametrize("case", list(MISMATCHES))
def test_a_mismatched_receive_raises_on_the_receiver_and_the_sender_ends(pool, case, sender_gone_first):
    # sender_gone_first: the receive used to raise RankFailedError ("rank 0 failed: Connection
    # closed by peer"), though rank 0 had sent its message and left the group, not failed.
    pids = pool.run(rank_pid)
    name = f"mismatch{list(MISMATCHES).index(case)}{'-gone' if sender_gone_first else ''}"
    results = pool.run(rank_mismatched_receive, case, name, sender_gone_first)
    assert results[0] == "sent" and results[2] is None
    assert isinstance(results[1], tuple), f"the receive did not raise: {results[1]}"
    op, seq, missing, text = results[1]
    assert (op, seq, missing) == ("recv", 1, [0])
    (shape, dtype) = MISMATCHES[case][1]
    expected = f"(shape={shape}, dtype={str(dtype).removeprefix('torch.')})"
    assert "rank 0 sent the message with tag 5 in another shape or dtype" in text, text
    assert expected in text and "debug=True" in text, text
    assert pool.run(rank_pid) == pids  # no rank died, and the pool's group still works


def rank_matching_messages(b):
    """A ring on many tags (up to the largest a user may pass), shapes and dtypes, including the
    ones that travel as bytes and a 16 MiB tensor, receives posted in the opposite order; then
    messages of different sizes one after another on one tag."""
    right, left = (b.rank + 1) % b.world_size, (b.rank - 1) % b.world_size
    messages = [(0, (3,), torch.float32), (1, (3, 1), torch.float32), (77, (2, 2), torch.int16),
                (1000, (5,), torch.complex64), (2**20 - 1, (4,), torch.bool),
                (12345, (2, 3), torch.bfloat16), (9, (2**22,), torch.float32), (10, (1,), torch.int64)]
    for i, (tag, shape, dtype) in enumerate(messages):
        b.send((torch.arange(math.prod(shape)) % 2 + b.rank + i).to(dtype).reshape(shape), right, tag)
    works = [(b.irecv(torch.empty(shape, dtype=dtype), left, tag), i, shape, dtype)
             for i, (tag, shape, dtype) in reversed(list(enumerate(messages)))]
    for work, i, shape, dtype in works:
        expected = (torch.arange(math.prod(shape)) % 2 + left + i).to(dtype).reshape(shape)
        if not torch.equal(work.wait(), expected):
            return f"message {i} differs"
    for n in (1, 1000, 2):
        b.send(torch.full((n,), float(n + b.rank)), right, tag=3)
    for n in (1, 1000, 2):
        if not torch.equal(b.recv(torch.empty(n), left, tag=3), torch.full((n,), float(n + left))):
            return f"message of {n} on one tag differs"
    return "ok"


def test_matching_messages_on_many_tags_and_sizes_arrive(pool):
    assert pool.run(rank_matching_messages) == ["ok"] * 3


def rank_send_after_the_receive_gave_up(b):
    """Rank 1's receive times out (which closes its group's connections); rank 0 sends after that."""
    sub = fresh_group(b, "late-send", 1.0)
    try:
        if sub.rank == 1:
            with pytest.raises(CollectiveTimeoutError):
                sub.recv(torch.zeros(2), 0)
            time.sleep(2.0)  # alive while rank 0 sends: no departure explains it
            return None
        if sub.rank == 0:
            time.sleep(1.8)
            try:
                sub.send(torch.ones(2), 1)
                sub.send(torch.ones(2), 1)  # Gloo may take the first before it sees the closed socket
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                return type(exc).__name__, getattr(exc, "failed_rank", None), str(exc)
            return "sent"
        return None
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            sub.shutdown()


def test_a_send_to_a_rank_whose_receive_gave_up_raises_a_distframe_error(pool):
    # It used to raise Gloo's RuntimeError "Connection closed by peer ... GLHF!".
    pids = pool.run(rank_pid)
    name, failed_rank, text = pool.run(rank_send_after_the_receive_gave_up)[0]
    assert (name, failed_rank) == ("RankFailedError", 1), text
    assert "send (message 1 with tag 0 to rank 1)" in text or "send (message 2" in text, text
    assert "gave up on a call at its timeout" in text and "GLHF" not in text, text
    assert pool.run(rank_pid) == pids
