"""The exceptions distframe raises. Every one derives from :class:`DistFrameError`."""
from __future__ import annotations

from collections.abc import Sequence


class DistFrameError(Exception):
    """Base class of every error distframe raises on purpose."""


class ConfigError(DistFrameError, ValueError):
    """A user setting is invalid; the message names the setting and the fix."""


class BackendUnavailableError(DistFrameError, RuntimeError):
    """An engine cannot run here (a library or a device is missing); the message says what to install."""


class CollectiveTimeoutError(DistFrameError, TimeoutError):
    """A collective did not complete within the backend's timeout.

    Attributes name the operation, its per-group sequence number and the ranks (of the group the
    call was made on) that did not arrive, where the engine can tell (``None`` where it cannot).
    """

    def __init__(self, op: str, seq: int, missing_ranks: Sequence[int] | None, timeout: float,
                 detail: str = "", early: bool = False) -> None:
        self.op = op
        self.seq = seq
        self.missing_ranks = None if missing_ranks is None else sorted(missing_ranks)
        self.timeout = timeout
        who = ("unknown ranks" if self.missing_ranks is None
               else f"ranks {self.missing_ranks} did not arrive")
        # early: the rank stopped after ``timeout`` seconds, before its timeout ran out, because
        # the missing ranks can never arrive (they left the group or are stuck behind it)
        waited = (f"stopped after {timeout:g} s, before its timeout" if early
                  else f"timed out after {timeout:g} s")
        message = f"{op} (sequence number {seq}) {waited}: {who}"
        if detail:
            message += f"; {detail}"
        super().__init__(message)
        self._args = (op, seq, missing_ranks, timeout, detail, early)

    def __reduce__(self):  # picklable, so process launchers can carry it back to the caller
        return type(self), self._args


class CollectiveMismatchError(DistFrameError, ValueError):
    """Ranks of one group called different operations, shapes, dtypes or arguments at the same step."""

    def __init__(self, op: str, seq: int, detail: str) -> None:
        self.op = op
        self.seq = seq
        super().__init__(f"{op} (sequence number {seq}): ranks disagree: {detail}")
        self._args = (op, seq, detail)

    def __reduce__(self):
        return type(self), self._args


class RankFailedError(DistFrameError, RuntimeError):
    """A peer rank raised or died, so this rank stopped instead of waiting for its timeout."""

    def __init__(self, failed_rank: int | None, detail: str = "") -> None:
        self.failed_rank = failed_rank
        who = "a peer rank" if failed_rank is None else f"rank {failed_rank}"
        super().__init__(f"{who} failed{': ' + detail if detail else ''}; this rank stopped")
        self._args = (failed_rank, detail)

    def __reduce__(self):
        return type(self), self._args


def rebuild_exception(cls: type, args: tuple, attributes: dict) -> BaseException:
    """An exception raised in a rank's process, from its class, ``args`` and ``__dict__``: most of
    distframe's errors take other constructor arguments than their ``args``, so pickle alone
    cannot rebuild them."""
    exc = cls.__new__(cls, *args)
    if cls.__module__ == "builtins":
        # Their __init__ sets fields that are not in __dict__ (SystemExit.code, which
        # raise_first_failure reports; OSError.errno): without it they came back None.
        cls.__init__(exc, *args)
    exc.args = args
    exc.__dict__.update(attributes)
    return exc
