"""How the Gloo and NCCL engine waits for a process group's operation, and what it raises when
one fails: waits in slices asking whether a peer has departed (Gloo), a reduce_scatter watched by
the progress board instead ([Note: watching a receive] in ``torch_dist_board``), and transport
errors translated into CollectiveTimeoutError, RankFailedError or CollectiveMismatchError."""
from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from typing import Any

from distframe.backends.base import Call
from distframe.backends.call_slots import CallSlots
from distframe.backends.departures import in_world, subgroup_world_ranks, world_note
from distframe.backends.torch_dist_board import (DEPARTURE_SETTLE_S, WatchedWait, cut_waits, peer_lost,
                                                 wait_in_slices)
from distframe.errors import CollectiveTimeoutError, RankFailedError

_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\]\s*")


class TorchDistWaits:
    """Mixed into TorchDistributedBackend (which provides the attributes below)."""

    engine: str
    timeout: float
    _rank: int
    _world_size: int
    _pg: Any
    _shared: Any
    _slots: CallSlots
    _progress_keys: dict[int, str]
    _peer_progress_keys: dict[int, str]
    _wait_slice: datetime.timedelta
    #: The world rank of each rank of this group; None for the world itself, or a group that
    #: numbers its ranks as it does ([Note: ranks of the world] in ``departures``).
    _world_ranks: list[int] | None = None

    def _place_in_world(self, group: TorchDistWaits, ranks: list[int]) -> TorchDistWaits:
        """``group``, a subgroup of this group's ``ranks``, told what their ranks in the world are."""
        group._world_ranks = group._slots.world_ranks = subgroup_world_ranks(self._world_ranks, ranks)
        return group

    def _complete(self, call: Call, issue: Callable[..., Any], *args: Any) -> None:
        """Issues one process-group operation and waits for it, translating transport failures."""
        self._await(issue(*args), call.op, call.seq)

    def _await(self, work: Any, op: str, seq: int) -> None:
        if op == "reduce_scatter" and self._wait_slice:  # Gloo's cannot be sliced: watched instead
            self._await_watched(work, op, seq)
            return
        try:
            work.wait(self._wait_slice)
            return
        except RuntimeError as exc:
            first = exc
        # Outside the except block, so that what it raises does not chain "Operation timed out!".
        self._await_rest(work, first, op, seq)

    def _await_watched(self, work: Any, op: str, seq: int) -> None:
        """Waits for ``work`` in one piece while the board asks whether a peer has departed or
        called something else, and cuts the wait if so ([Note: watching a receive])."""
        watched = WatchedWait(lambda waited: self._departure_error(op, seq, waited), self._cut_waits)
        self._shared.board.watch(watched)
        failure = None
        try:
            work.wait()
        except RuntimeError as exc:
            failure = exc
        finally:
            self._shared.board.unwatch(watched)
        error = watched.error or (failure and self._comm_error(failure, op, seq, None))
        if error is not None:  # (a call completed as the board cut it raises too: the group is cut)
            raise error from (None if error is watched.error else failure)
        if failure is not None:
            raise failure

    def _cut_waits(self) -> None:
        pg = self._pg
        if pg is not None:  # (None: shut down meanwhile, which ended the wait)
            cut_waits(pg, list(self._peer_progress_keys))

    def _await_rest(self, work: Any, exc: RuntimeError, op: str, seq: int) -> None:
        """``_await`` once the first wait raised ``exc``, perhaps only because the slice ended."""
        if self._wait_slice:
            failure = wait_in_slices(work, self._wait_slice,
                                     lambda waited: self._departure_error(op, seq, waited))
            if failure is None:
                return
            exc = failure
        error = self._comm_error(exc, op, seq, None)
        if error is None:
            raise exc
        raise error from exc

    def _departure_error(self, op: str, seq: int, waited: float, settle: float = 0.0,
                         peer_keys: dict[int, str] | None = None) -> Exception | None:
        keys = self._peer_progress_keys if peer_keys is None else peer_keys  # of the ranks waited for
        error = self._slots.error(op, seq)  # ranks that called something else (in new_group too)
        error = error or self._shared.board.departure_error(keys, op, seq, waited, settle)
        if error is not None:
            self._shared.failed = True
        return in_world(error, self._world_ranks)

    def _missing_ranks(self, seq: int) -> list[int] | None:
        return self._shared.board.behind(self._progress_keys, seq)

    def _comm_error(self, exc: BaseException, op: str, seq: int, peers: list[int] | None,
                    timeout: float | None = None, hint: str = "") -> Exception | None:
        """The distframe error for a transport failure (None if ``exc`` is not one). ``peers``:
        the ranks being waited for when known (point to point); else read from the board.
        ``hint`` ends the message of a timeout."""
        text = str(exc).strip()
        lowered = text.lower()
        timed_out = "timed out" in lowered or "timeout" in lowered
        if not timed_out and not peer_lost(exc):
            return None
        self._shared.failed = True
        if peers is None and (mismatch := self._slots.error(op, seq)) is not None:
            return mismatch
        if peers is None and not timed_out:  # a peer that departs may close its connections first
            departed = self._departure_error(op, seq, 0.0, DEPARTURE_SETTLE_S)
            if departed is not None:
                return departed
        detail = f"{self.engine} reported: " + _SOURCE_LOCATION.sub("", text.splitlines()[0] if text else "")
        missing = peers if peers is not None else self._shared.board.behind(self._peer_progress_keys, seq)
        if missing == []:
            detail += "; every rank had reached this call"
        if timed_out:
            if peers is None:  # a collective: peers waiting in it, or late for it, stop at once
                self._slots.give_up(op, seq, missing or None, timeout or self.timeout)
            return CollectiveTimeoutError(op, seq, missing or None, timeout or self.timeout,
                                          world_note(missing, self._world_ranks) + detail + hint)
        if peers is not None and self.world_size > 2:
            # Gloo fails every pending call of a process when any of its connections closes: the
            # sender waited for may be alive and the rank that died another, unnamed here (a
            # killed process departs from nothing; spawn names the one that exited).
            detail += (f" (while receiving from rank {peers[0]}; a connection to any rank of the group "
                       "ends every pending call, so the rank that failed may be another)")
            missing = []
        return in_world(RankFailedError(missing[0] if missing and len(missing) == 1 else None,
                                        f"{op} (sequence number {seq}): {detail}"), self._world_ranks)
