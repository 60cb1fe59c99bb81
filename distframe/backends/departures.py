"""Departures: a rank says that it will make no further call on a group, so that peers waiting for
it there stop at once instead of at the timeout. Used by the Gloo/NCCL and MPI engines, whose
progress boards (``torch_dist_board``, ``mpi_progress``) carry the announcements.

[Note: departures] A rank departs when its function under a launcher has returned or raised, or
when it shuts a backend down (``depart`` on the engines; ``shutdown`` departs from that group and
the groups made from it). A backend that is garbage, or still open when the interpreter exits,
departs after the last call it entered; one from ``init_backend`` departs when the script ends
(``distframe.launch``, [Note: the script is the rank's function]). It records, per group, how
many calls it had issued there and whether it failed. A rank whose call has not completed asks,
every fraction of a second while it waits (never on a call that completes on the fast path),
whether a peer of the group has departed:

* a peer that failed: RankFailedError naming it, as when the in-memory engine aborts;
* a peer that left having issued fewer calls than this call's sequence number can never arrive:
  CollectiveTimeoutError naming the call, its sequence number and that rank;
* a receive from a peer that left: ``backend.departures()`` says how many messages it sent
  first, so a caller can tell whether the one it waits for is still on its way;
* a peer that left after issuing this call is waited for as usual: its call runs (perhaps still
  on its communication thread). So ranks that end at slightly different times, or a peer still
  in its last call when another leaves, see no error.
* an MPI rank that only sends in a rooted call completes it without waiting, peer or no peer: it
  reads the departures once the call is done, and a call some peer has not been seen making is
  compared with the peers' call counts when an ``MPIPool`` run ends (``skipped_call_errors``;
  [Note: calls a peer never made] in ``mpi``).

A receive works the same way, counted per channel (sender, receiver, tag): a departure also
records how many messages the rank had sent on each channel (``sent``), so a receive of message
``n`` from a rank that left having sent fewer stops at once (``receive_departure_error``), while
a message it did send before leaving is still waited for and received, even when it failed
after sending it (the in-memory engine, whose mailbox holds it, delivers it too); the receive
after that one then raises RankFailedError.

[Note: sends to a rank that left] A departure also records how many receives the rank had posted
on each channel (``received``): message ``n`` to a rank that left having posted fewer can never
be received. What that costs the sender depends on how the engine sends, as in MPI, where a
buffered send completes locally and a rendezvous send needs its receiver:

* in-memory and Gloo sends are buffered: ``send``/``isend`` return at once whoever receives.
  The in-memory engine's ``shutdown`` does not wait for sends; Gloo's waits for its unfinished
  ones (the transport needs the receiver), but drops at once, with a ``RuntimeWarning`` naming
  the channels, those to a rank that left without receiving them (``send_departure_error``),
  and after its timeout those never received at all. A warning, not an error: a shutdown runs
  as cleanup, often while another error propagates, and nothing is left to deliver to.
* MPI sends small messages eagerly (complete at once) and large ones by rendezvous: a wait for
  one whose receiver left without posting its receive raises at once what the timeout would
  have (CollectiveTimeoutError naming ``send``, the message's number and the receiver;
  RankFailedError when it failed). MPI's ``shutdown`` never waits for sends.

Each engine marks the group unusable after such an error, as after a timeout: the call that was
abandoned cannot be cancelled. Where the engines differ:

* Gloo asks the store after each ``torch_dist_board.WAIT_SLICE`` (0.2 s) of a wait; a lost
  connection (a departing rank's groups close theirs) is put down to a departure that shows
  within half a second. NCCL's waits are not sliced (its ``wait(timeout)`` fails the work), so
  there a departure is named only in the error of a lost connection. ``new_group``'s members
  meet in the store (polled, asking about departures every slice) before torch's rendezvous in
  the process group's constructor, which cannot be interrupted; a member that leaves after
  entering ``new_group`` but before that rendezvous ends is seen only at the timeout, or when
  its connections close. Receives and reduce_scatter (whose waits cannot be sliced):
  ``torch_dist_board``, [Note: watching a receive].
* MPI reads its peers' words in shared memory every 50 ms once a call has spun for 50 ms; it
  sees the departures of ranks on its own node only.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from distframe.errors import CollectiveTimeoutError, RankFailedError


@dataclasses.dataclass(frozen=True)
class Departure:
    """How a rank left a group: after issuing ``issued`` calls there; ``failed`` if it raised;
    ``sent``: how many point-to-point messages it had sent, by (destination rank, tag), and
    ``received``: how many receives it had posted, by (source rank, tag); None when unknown (an
    MPI rank with more channels than its progress page holds)."""

    issued: int
    failed: bool = False
    sent: Mapping[tuple[int, int], int] | None = None
    received: Mapping[tuple[int, int], int] | None = None


def departure_error(departed: dict[int, Departure], op: str, seq: int,
                    waited: float) -> Exception | None:
    """The error for a rank that has waited ``waited`` seconds in call ``seq`` (``op``) of a group
    whose ranks ``departed`` have left it; None when every rank it may wait for can still come."""
    failed = sorted(rank for rank, d in departed.items() if d.failed)
    if failed:
        return RankFailedError(failed[0], f"{op} (sequence number {seq}): it raised and left the group")
    gone = {rank: d for rank, d in departed.items() if d.issued < seq}
    if not gone:
        return None
    return _left_without_error(gone, op, seq, waited, "so this rank stopped at once instead of waiting "
                               "for the timeout; the group is unusable now, shut it down")


def skipped_call_errors(calls: list[tuple[int, list[tuple[int, str]]] | None],
                        failed: Collection[int]) -> dict[int, Exception]:
    """At the end of a run: the error for each rank that did not fail and completed a call that some
    peer never made, which MPI allows on a rank that only sends in a rooted collective
    ([Note: calls a peer never made] in ``mpi``). ``calls[rank]``: how many calls the rank issued
    on the group, and (sequence number, op) of those that completed before it saw every peer
    make them; None when unknown (then nothing is said). ``failed``: the ranks that raised. The
    error names the rank's first such call: RankFailedError if a rank that never made it failed
    (its own error is the one to report), else CollectiveTimeoutError naming the ranks that left."""
    if any(record is None for record in calls):
        return {}
    issued = [record[0] for record in calls]
    errors: dict[int, Exception] = {}
    for rank, (_, unconfirmed) in enumerate(calls):
        if rank in failed:
            continue
        for seq, op in sorted(unconfirmed):
            gone = {peer: Departure(n, peer in failed) for peer, n in enumerate(issued) if n < seq}
            broken = sorted(peer for peer, d in gone.items() if d.failed)
            if broken:
                errors[rank] = RankFailedError(broken[0], f"{op} (sequence number {seq}): it raised and "
                                                          "left the group without making this call")
            elif gone:
                errors[rank] = _left_without_error(
                    gone, op, seq, 0.0, "though this rank's part completed without it (MPI sends small "
                    "messages at once), so the launcher raised this when the run ended")
            if rank in errors:
                break
    return errors


def _left_without_error(gone: dict[int, Departure], op: str, seq: int, waited: float,
                        consequence: str) -> CollectiveTimeoutError:
    """Call ``seq`` (``op``) cannot complete: the ranks ``gone`` left the group before making it."""
    ranks = sorted(gone)
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    calls = " and ".join(str(gone[rank].issued) for rank in ranks)
    return CollectiveTimeoutError(
        op, seq, ranks, round(waited, 1),
        f"{who} left the group after {calls} calls, without making this one (its function returned "
        f"or it shut the backend down), {consequence}", early=True)


def receive_departure_error(departed: Departure | None, src: int, receiver: int, tag: int, seq: int,
                            waited: float) -> Exception | None:
    """The error for rank ``receiver`` that has waited ``waited`` seconds for message ``seq`` from
    ``src`` with ``tag`` when ``src`` left as ``departed``; None when ``src`` has not left, or did
    send that message (it may still arrive), or when what it sent is unknown."""
    return _p2p_departure_error("recv", None if departed is None else departed.sent, departed,
                                src, receiver, tag, seq, waited)


def send_departure_error(departed: Departure | None, dst: int, sender: int, tag: int, seq: int,
                         waited: float) -> Exception | None:
    """The error for rank ``sender`` whose message ``seq`` to ``dst`` with ``tag`` has not been
    received after ``waited`` seconds when ``dst`` left as ``departed``; None when ``dst`` has not
    left, or did post the receive (it may still complete), or when what it received is unknown
    ([Note: sends to a rank that left])."""
    return _p2p_departure_error("send", None if departed is None else departed.received, departed,
                                dst, sender, tag, seq, waited)


def _p2p_departure_error(op: str, counts: Mapping[tuple[int, int], int] | None,
                         departed: Departure | None, peer: int, me: int, tag: int, seq: int,
                         waited: float) -> Exception | None:
    """What ``op`` of message ``seq`` (``tag``) between this rank, ``me``, and ``peer`` raises when
    ``peer`` left having done ``counts[(me, tag)]`` of its side of that channel."""
    if departed is None or counts is None:
        return None
    done = counts.get((me, tag), 0)
    if done >= seq:
        return None
    verb, way = ("sending", "from") if op == "recv" else ("receiving", "to")
    what = f"{op} (message {seq} with tag {tag} {way} rank {peer})"
    if departed.failed:
        return RankFailedError(peer, f"{what}: it raised and left the group without {verb} it")
    return CollectiveTimeoutError(
        op, seq, [peer], round(waited, 1),
        f"rank {peer} left the group after {verb} {done} messages with tag {tag} "
        f"{'to' if op == 'recv' else 'from'} rank {me}, so this {op} stopped at once instead of "
        "waiting for the timeout; the group is unusable now, shut it down", early=True)


def gave_up_error(op: str, seq: int, missing, timeout: float, who: int | None, now_op: str,
                  now_seq: int, world_ranks: list[int] | None = None) -> CollectiveTimeoutError:
    """What a rank raises once call ``seq`` (``op``) of its group has been given up on at a
    timeout, by peer ``who`` or (None) by this rank itself, when it is at call ``now_seq``
    (``now_op``): every rank names the same call, its sequence number and the ranks that had not
    arrived by then (``missing``: None where the rank that gave up could not tell), so peers
    still waiting, or late, stop at once ([Note: after a timeout] in ``call_slots``). Ranks are
    also named in the world when ``world_ranks`` is given ([Note: ranks of the world])."""
    if who is None:
        detail = "this rank gave up on this call when its timeout ran out"
    else:
        where = "" if world_ranks is None else f" (global rank {world_ranks[who]})"
        detail = (f"rank {who}{where} gave up on this call when its timeout ran out, so it can never "
                  "complete")
    detail += (": this rank stopped at once" if who is not None and now_seq == seq
               else f": {now_op} (sequence number {now_seq}) was not issued")
    return CollectiveTimeoutError(op, seq, missing, timeout, f"{world_note(missing, world_ranks)}{detail}; "
                                  "the group is unusable now, shut it down")


# [Note: ranks of the world] An error names the missing ranks as the group numbers them (its
# ``missing_ranks``), but in new_group([2, 1, 0]) the group's rank 2 is the world's rank 0, and
# the world's rank 2 may be the very rank reading "ranks [2] did not arrive". So every engine, on
# every rank, follows that with the same ranks as the world (the top-level backend the group was
# made from) numbers them, in the words of ``world_note``. ``world_ranks``: the world rank of
# each rank of the group, or None for the world itself or a group that numbers its ranks as it.
def world_ranks_of(global_ranks: list[int]) -> list[int] | None:
    """``global_ranks`` (the world rank of each rank of a group), or None where they number the
    ranks as the group does, so the errors of such a group say nothing more."""
    return None if global_ranks == list(range(len(global_ranks))) else list(global_ranks)


def subgroup_world_ranks(parent: list[int] | None, ranks: list[int]) -> list[int] | None:
    """``world_ranks_of`` the subgroup ``new_group(ranks)`` makes of a group whose own world
    ranks are ``parent`` (None: the group numbers its ranks as the world does)."""
    return world_ranks_of([parent[r] for r in ranks] if parent is not None else list(ranks))


def world_note(missing, world_ranks: list[int] | None) -> str:
    """The group ranks ``missing`` as the world numbers them, worded to follow "ranks [..] did not
    arrive; " and ending in "; ", or "" when the group numbers its ranks as the world does or
    nothing is known missing."""
    if not missing or world_ranks is None:
        return ""
    ranks = [world_ranks[r] for r in sorted(missing)]
    return f"that is, global ranks {ranks} of the world this group was made from; "


def in_world(error: BaseException | None, world_ranks: list[int] | None) -> BaseException | None:
    """``error``, or a copy of a CollectiveTimeoutError that names its missing ranks in the world
    too ([Note: ranks of the world]), or of a RankFailedError its failed rank (a subgroup's rank 1
    named alone sent every peer looking at the world's rank 1), for engines that build their errors
    without knowing it."""
    if world_ranks is None:
        return error
    if isinstance(error, RankFailedError) and error.failed_rank is not None:
        rank, detail = error._args
        note = f"global rank {world_ranks[rank]} of the world this group was made from"
        if world_ranks[rank] == rank or note in detail:
            return error
        return RankFailedError(rank, f"{note}; {detail}" if detail else note)
    if not isinstance(error, CollectiveTimeoutError) or not error.missing_ranks:
        return error
    note = world_note(error.missing_ranks, world_ranks)
    if note in str(error):
        return error
    op, seq, missing, timeout, detail, early = error._args
    detail = f"{note}{detail}" if detail else note.removesuffix("; ")
    return CollectiveTimeoutError(op, seq, missing, timeout, detail, early)
