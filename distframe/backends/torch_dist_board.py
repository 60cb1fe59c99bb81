"""ProgressBoard: each rank says in the store which call it has reached, so that a rank whose
collective timed out can name the ranks that never arrived.

[Note: the board costs nothing per call] A collective only records its sequence number in a
dict (one assignment). A background thread copies changed entries to the store at most every
``interval`` seconds, so the hot path makes no store round trip. An entry is therefore up to one
interval stale, which is far below any sensible timeout. The store is read only after a failure.
"""
from __future__ import annotations

import threading

import torch.distributed as dist


class ProgressBoard:
    """One per process, shared by a world backend and all its subgroups (each group uses its own
    keys). ``reached(key, seq)`` is the hot-path call; ``behind(keys, seq)`` the diagnosis."""

    def __init__(self, store: dist.Store, interval: float = 0.2) -> None:
        self._store = _own_connection(store)
        self._interval = interval
        self._latest: dict[str, int] = {}
        self._written: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self, key: str) -> None:
        """Publishes 0 for ``key`` now, so peers can always read it, and starts the writer."""
        self._store.set(key, "0")
        self._written[key] = self._latest[key] = 0
        if self._thread is None:
            self._thread = threading.Thread(target=self._publish_loop, name="distframe-progress",
                                            daemon=True)
            self._thread.start()

    def reached(self, key: str, seq: int) -> None:
        self._latest[key] = seq

    def behind(self, keys: dict[int, str], seq: int) -> list[int] | None:
        """The ranks (keys of ``keys``) whose published progress is below ``seq``; None when the
        store cannot be read (for example when the process hosting it has gone)."""
        try:
            return [rank for rank, key in sorted(keys.items()) if self._progress(key) < seq]
        except (RuntimeError, ValueError):
            return None

    def _progress(self, key: str) -> int:
        # check() first: get() on a key no one has set would block for the store's timeout.
        return int(self._store.get(key).decode()) if self._store.check([key]) else 0

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self._interval + 1)

    def _publish_loop(self) -> None:
        while not self._stop.wait(self._interval):
            for key, seq in list(self._latest.items()):
                if self._written.get(key) == seq:
                    continue
                try:
                    self._store.set(key, str(seq))
                except RuntimeError:  # the store is gone: nobody is left to read the board
                    return
                self._written[key] = seq


def _own_connection(store: dist.Store) -> dist.Store:
    """A second client connection where the store offers one, so that the writer thread never
    queues behind a blocking ``wait`` that Gloo's rendezvous makes on the main connection."""
    try:
        return store.clone()
    except (RuntimeError, AttributeError, NotImplementedError):
        return store
