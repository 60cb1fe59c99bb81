"""Gloo outside debug mode: a point-to-point message whose shape differs from its receive's but
whose tag fingerprint is the same ([Note: the message's shape in its tag] in ``torch_dist_p2p``),
so that Gloo delivers it. A smaller one was written into the first bytes of the receive's tensor
without a word, a larger one ended the receiving process (gloo::EnforceNotMet, std::terminate).
Now the receive compares the sender's description in this node's shared memory
(``sent_messages``, [Note: the sent-message table]) and raises CollectiveMismatchError."""
from __future__ import annotations

import mmap
import os
import warnings

import pytest
import torch

from distframe._process_launch import ProcessPool
from distframe.backends.torch_dist_p2p import message_tag
from distframe.errors import CollectiveMismatchError

pytestmark = pytest.mark.gloo

TAG = 5
SMALL = (8,)


def colliding_shape(shape: tuple[int, ...], seq: int = 1) -> tuple[int]:
    """The first 1-d float32 shape longer than ``shape`` whose message ``seq`` on ``TAG`` has the
    same tag on the wire as ``shape``'s (10 bits of fingerprint: about 1 in 1024 does)."""
    wire_tag = message_tag(TAG, torch.empty(shape), seq)
    for n in range(shape[0] + 1, 100_000):
        if message_tag(TAG, torch.empty(n), seq) == wire_tag:
            return (n,)
    raise AssertionError("no colliding shape below 100000 elements")


LARGE = colliding_shape(SMALL)  # (1779,) on torch 2.13
# (shape sent, shape of the receive, whether the receive is posted before the message is sent).
# Posted first: the receive cannot see the sender's description yet and compares it once the
# message has arrived. Sent first: it sees it before posting, and refuses the message.
CASES = {
    "smaller, receive posted first": (SMALL, LARGE, True),
    "smaller, sent first": (SMALL, LARGE, False),
    "larger, sent first": (LARGE, SMALL, False),  # it ended the receiving process
}


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(2, "gloo", timeout=30) as pool:
        yield pool


def rank_pid(b):
    b.barrier()
    return os.getpid()


def rank_colliding_message(b, case: str):
    """Rank 0 sends message 1 (of another shape than rank 1's receive) and message 2 (as its
    receive expects) on ``TAG`` of a group of their own; returns what each rank saw and the
    warnings of its shutdown."""
    from distframe.backends import GlooCommunicationBackend
    sent_shape, recv_shape, posted_first = CASES[case]
    sub = GlooCommunicationBackend(b.rank, b.world_size, b._shared.store, timeout=10.0,
                                   prefix=f"test-gloo-p2p-shapes/{list(CASES).index(case)}",
                                   **b._sibling_kwargs())
    if sub.rank == 0:
        if posted_first:
            b.barrier()  # rank 1 has posted its receive
        sub.send(torch.full(sent_shape, 7.0), 1, tag=TAG)
        sub.send(torch.arange(3.0), 1, tag=TAG)
        if not posted_first:
            b.barrier()  # rank 1 posts its receive only now: message 1 is described
        outcome = "sent"
    else:
        tensor = torch.full(recv_shape, -1.0)
        if not posted_first:
            b.barrier()
        work = sub.irecv(tensor, 0, tag=TAG)
        if posted_first:
            b.barrier()
        errors = []
        for _ in range(2):  # every wait raises it
            try:
                work.wait()
                errors.append(f"received without error: {tensor[:10].tolist()}")
            except CollectiveMismatchError as exc:
                errors.append((exc.op, exc.seq, str(exc)))
        untouched = bool((tensor == -1).all())
        following = sub.recv(torch.zeros(3), 0, tag=TAG).tolist()  # the channel is in step
        outcome = (errors, work.is_completed(), untouched, following)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sub.shutdown()
    return outcome, [str(w.message) for w in caught]


@pytest.mark.parametrize("case", list(CASES))
def test_a_colliding_message_of_another_shape_raises_on_the_receiver(pool, case):
    pids = pool.run(rank_pid)
    (sent, sender_warnings), (received, receiver_warnings) = pool.run(rank_colliding_message, case)
    sent_shape, recv_shape, posted_first = CASES[case]
    # The sender's send completes as any other: its message was received (into the engine's
    # buffer when refused), so its shutdown has nothing to drop.
    assert (sent, sender_warnings, receiver_warnings) == ("sent", [], [])
    errors, completed, untouched, following = received
    assert all(isinstance(e, tuple) for e in errors), f"the receive did not raise: {errors}"
    assert [e[:2] for e in errors] == [("recv", 1)] * 2 and errors[0][2] == errors[1][2]
    text = errors[0][2]
    assert f"rank 0 sent send(shape={sent_shape}, dtype=float32) with tag {TAG}" in text, text
    assert f"rank 1 expects send(shape={recv_shape}, dtype=float32)" in text, text
    assert "this node's shared memory" in text, text
    assert completed and following == [0.0, 1.0, 2.0]
    # A receive that saw the description first leaves the tensor as it was; one that had been
    # posted before got the message's bytes, and says so.
    assert untouched != posted_first
    assert ("now holds" in text) == posted_first, text
    assert pool.run(rank_pid) == pids  # no rank died, and the pool's group still works


def test_the_table_says_what_gloo_would_deliver():
    from distframe.backends.sent_messages import AREA_BYTES, MATCHES, SentMessages
    maps = [mmap.mmap(-1, AREA_BYTES) for _ in range(2)]
    sender, receiver = SentMessages(maps[0], {1: maps[1]}, 0, 0), SentMessages(maps[1], {0: maps[0]}, 1, 0)
    assert receiver.compare(0, TAG, 1, torch.empty(SMALL)) is None  # not sent yet
    sender.record(1, TAG, 1, torch.empty(LARGE), wire_tag=1234)
    assert receiver.compare(0, TAG, 1, torch.empty(LARGE)) is MATCHES
    other = receiver.compare(0, TAG, 1, torch.empty(SMALL))
    assert other == (f"send(shape={LARGE}, dtype=float32)", 4 * LARGE[0], 1234)
    assert receiver.compare(0, TAG + 1, 1, torch.empty(SMALL)) is None  # another channel's
