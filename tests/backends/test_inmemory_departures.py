"""In-memory ranks that leave a group, calls that fail, and receives that wait in vain: a rank
that shut a backend down is not waited for (as on Gloo and MPI: test_departures.py), a call
that ended in a mismatch does not keep its inputs alive, and a receive that timed out says which
tags its sender did use."""
import gc
import threading
import weakref

import pytest
import torch

from distframe import spawn
from distframe.errors import CollectiveMismatchError, CollectiveTimeoutError

# Long enough that a test passing on the old code (which waited it out) would have to say so
# with the timeout's own message, which every departure test here refuses ("left the group").
TIMEOUT = 3.0
WORLD = 3
LEAVER = WORLD - 1


def _outcome(call):
    """What ``call()`` raised (op, sequence number, missing ranks, message), or "completed"."""
    try:
        call()
    except CollectiveTimeoutError as exc:
        return exc.op, exc.seq, exc.missing_ranks, str(exc)
    return "completed"


@pytest.mark.parametrize("where", ["world all_reduce", "subgroup barrier", "world recv",
                                   "subgroup irecv"])
def test_a_rank_that_shut_a_backend_down_and_lives_on_is_not_waited_for(where):
    """The last rank shuts down the world's backend (which ends its subgroups too) or only a
    subgroup whose rank order is reversed, and stays alive until its peers have their outcome:
    they stop at once, naming the call, its sequence number and the rank that left (in the
    group's own numbering), instead of waiting out the timeout. A message sent before leaving
    is still received."""
    outcomes_in = threading.Barrier(WORLD - 1)
    peers_done = threading.Event()

    def fn(b):
        sub = b.new_group(list(range(WORLD))[::-1])  # world call 1; the leaver is sub's rank 0
        group = sub if where.startswith("subgroup") else b
        leaver = group.rank if b.rank == LEAVER else (0 if group is sub else LEAVER)
        if b.rank == LEAVER:
            group.send(torch.full((2,), 7.0), group.world_size - 1 - leaver, tag=3)
            group.shutdown()
            if not peers_done.wait(TIMEOUT * 4):
                raise RuntimeError("the peers never got an outcome")
            return None
        try:
            if where.endswith("recv"):
                if b.rank != 0:  # rank 0 of the world receives from the leaver
                    return "no call"
                receive = group.recv if where == "world recv" else (
                    lambda t, src, tag: group.irecv(t, src, tag).wait())
                first = receive(torch.zeros(2), leaver, 3)
                if first.tolist() != [7.0, 7.0]:
                    return f"received {first.tolist()}"
                return ("recv", 2, [leaver]), _outcome(lambda: receive(torch.zeros(2), leaver, 3))
            expected = ("all_reduce" if where.endswith("all_reduce") else "barrier",
                        group.stats.total_calls() + 1, [leaver])
            call = group.all_reduce if where.endswith("all_reduce") else lambda _: group.barrier()
            return expected, _outcome(lambda: call(torch.ones(2)))
        finally:
            outcomes_in.wait()
            peers_done.set()
    results = spawn(fn, WORLD, timeout=TIMEOUT)
    waiting = [r for r in results[:LEAVER] if r != "no call"]
    assert waiting
    for expected, outcome in waiting:
        assert outcome != "completed"
        *named, text = outcome
        assert tuple(named) == expected, text
        assert "left the group after" in text and "before its timeout" in text, text


@pytest.mark.parametrize("late_rank", [None, 2])
def test_a_mismatched_call_lets_go_of_every_rank_input(late_rank):
    """Rank 1 passes a tensor of another shape: every rank raises CollectiveMismatchError, and no
    rank's input stays referenced by the group afterwards, even while a rank (``late_rank``) has
    yet to make the call and see the error; the group goes on working."""
    refs: dict[int, weakref.ref] = {}
    early_done = threading.Barrier(WORLD - (late_rank is not None))
    checked = threading.Event()

    def fn(b):
        if b.rank == late_rank and not checked.wait(TIMEOUT * 4):
            raise RuntimeError("the early ranks never checked their inputs")
        t = torch.ones(4 if b.rank == 1 else 3)
        refs[b.rank] = weakref.ref(t)
        raised = False
        try:
            b.all_reduce(t)
        except CollectiveMismatchError:
            raised = True
        del t
        if b.rank != late_rank:
            early_done.wait()  # every early rank has seen the error and dropped its tensor
            gc.collect()
            alive = sorted(r for r, ref in refs.items() if ref() is not None and r != late_rank)
            early_done.wait()
            checked.set()
        else:
            gc.collect()
            alive = sorted(r for r, ref in refs.items() if ref() is not None)
        return raised, alive, b.all_reduce(torch.ones(1)).item()
    assert spawn(fn, WORLD, timeout=TIMEOUT) == [(True, [], float(WORLD))] * WORLD


def test_a_receive_that_timed_out_names_the_tags_its_sender_did_use():
    """Rank 0 sent rank 1 two messages with tag 3 and one with tag 5; rank 1 waits for tag 4.
    Its timeout says what is waiting from rank 0 under the other tags."""
    sent, answered = threading.Event(), threading.Event()

    def fn(b):
        if b.rank == 0:
            b.send(torch.ones(1), 1, tag=3)
            b.send(torch.ones(1), 1, tag=3)
            b.send(torch.ones(1), 1, tag=5)
            b.send(torch.ones(1), 2, tag=4)  # to another rank: not rank 1's concern
            sent.set()
            # Stays until rank 1 has its outcome: a rank that returned is not waited for.
            if not answered.wait(TIMEOUT * 4):
                raise RuntimeError("rank 1 never got an outcome")
            return None
        if b.rank == 2:
            return b.recv(torch.zeros(1), 0, tag=4).item()
        if not sent.wait(TIMEOUT * 4):
            raise RuntimeError("rank 0 never sent")
        try:
            return _outcome(lambda: b.irecv(torch.zeros(1), 0, tag=4).wait(timeout=0.5))
        finally:
            answered.set()
    outcome = spawn(fn, 3, timeout=TIMEOUT)[1]
    assert outcome[:3] == ("recv", 1, [0])
    assert ("rank 0 sent this rank 2 messages with tag 3 and 1 message with tag 5 that no receive "
            "has taken yet: did you mean tag 3 or tag 5?") in outcome[3], outcome[3]
