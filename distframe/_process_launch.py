"""Ranks as processes for the torch.distributed engines: ``spawn_processes`` (one call, fresh
processes) and ``ProcessPool`` (persistent workers that keep their backends between calls).

The parent hosts the rendezvous: a TCPStore server on a free port (port 0, so no race for a
port), whose address the children receive. Functions travel by reference, pickled: a function
must be importable in the child (module-level, in a module on ``sys.path``). Each child gets the
parent's ``sys.path`` and environment, so what the parent can import, the child can too.

[Note: start method] A process in which torch has run must never be forked, so children are
never forked from the caller. By default they come from a "forkserver": a fresh process that
imports torch once, computes nothing, and forks a child per rank, so a pool starts in well under
a second instead of paying torch's import (seconds) in every rank. ``start_method="spawn"``
starts every rank as a fresh interpreter instead.

[Note: failures] When a rank raises, the others get a short grace period to finish (they often
fail in the same way, and their own errors are then reported too); ranks still running after it
are terminated. The first original error (lowest rank, peers' RankFailedError aside) is re-raised
with a note naming its rank and its remote traceback. A pool whose run timed out, lost a process
or was terminated starts fresh workers, with fresh backends, on its next run; so does one in
which a rank raised and a message was sent but not received, or a receive posted with no message
(``launch.messages_unmatched``): a later run's receive on that channel would get the stale message, or
the one meant for the receive after it.

[Note: departures between runs] A rank whose function returns or raises departs
(``distframe.backends.departures``): peers still waiting for it in a call it never made stop at
once instead of at the timeout. Its backend serves the next run, so before each run, when every
rank has answered, the pool clears the departures announced in the last one.
"""
from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from distframe._launcher_watch import watch_launcher
from distframe.backends.base import DEFAULT_TIMEOUT
from distframe.backends.validation import check_timeout
from distframe.backends.torch_dist_board import clear_departures
from distframe.errors import CollectiveTimeoutError, ConfigError, RankFailedError, rebuild_exception
from distframe.launch import (messages_unmatched, p2p_counts, process_exited, raise_first_failure,
                              unimportable_task, unpicklable_result)

_GRACE_S = 1.0
_STOP_S = 10.0


def spawn_processes(fn: Callable[..., Any], world_size: int, backend: str, *,
                    timeout: float = DEFAULT_TIMEOUT, **backend_kwargs: Any) -> list:
    """Runs ``fn(backend)`` in ``world_size`` fresh processes; returns the results in rank order.
    Every process has ended when this returns or raises."""
    with ProcessPool(world_size, backend, timeout=timeout, **backend_kwargs) as pool:
        return pool.run(fn)


class ProcessPool:
    """``world_size`` persistent worker processes, each holding rank r's backend of one group.

    ``run(fn, *args, **kwargs)`` calls ``fn(backend, *args, **kwargs)`` on every rank and returns
    the results in rank order; the same backend objects serve every run (their ``stats`` and
    sequence numbers carry over). Starting a process costs seconds, so tests share a pool.
    ``close()`` (or leaving the ``with`` block) stops the workers.
    """

    def __init__(self, world_size: int, backend: str = "gloo", *, timeout: float = DEFAULT_TIMEOUT,
                 start_method: str = "forkserver", **backend_kwargs: Any) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
        if backend not in ("gloo", "nccl"):
            raise ConfigError(f"ProcessPool runs 'gloo' or 'nccl' ranks, not {backend!r}")
        import torch.distributed as dist
        if backend == "nccl":
            from distframe.backends.torch_dist import require_gpus
            require_gpus(world_size)
        if start_method not in ("forkserver", "spawn"):
            raise ConfigError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}; "
                              "ranks are never forked from a process that has run torch")
        self.world_size = world_size
        self.start_method = start_method
        self.backend = backend
        self.timeout = check_timeout(timeout)  # before the store, which fails on one past 1e9 s
        self._backend_kwargs = backend_kwargs
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self.timeout))
        self._generation = 0
        self._workers: list[_Worker] = []
        self._needs_restart = False
        self._closed = False
        self._start_workers()

    def __enter__(self) -> ProcessPool:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list:
        """``fn(backend, *args, **kwargs)`` on every rank; results in rank order. If any rank
        raises, the first original error is re-raised here with its rank named."""
        if self._closed:
            raise ValueError("run() on a closed ProcessPool; create a new one")
        task = pickle.dumps((fn, args, kwargs))  # fails here, in the caller, for a lambda
        if self._needs_restart:
            self._stop_workers(graceful=False)
            self._start_workers()
        clear_departures(self._store, self._prefix)  # [Note: departures between runs]
        for worker in self._workers:
            worker.connection.send_bytes(task)
        results, errors = self._collect()
        if errors:
            raise_first_failure(errors)
        return results

    def close(self) -> None:
        """Stops the workers (each shuts its backend down). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_workers(graceful=True)
        self._store = None

    # ---- workers -----------------------------------------------------------------------------
    def _start_workers(self) -> None:
        if multiprocessing.current_process().daemon:  # multiprocessing's AssertionError otherwise
            raise ConfigError(
                f"spawn(..., backend={self.backend!r}) inside a rank of a spawned process group: "
                "its rank processes cannot start processes of their own; use the rank's backend "
                "(or backend.new_group(...)) for the inner work, or backend='inmemory' for it")
        self._generation += 1
        context = _start_context(self.start_method)
        host, port = "127.0.0.1", self._store.port
        prefix = f"distframe/pool{os.getpid()}-{id(self)}/generation{self._generation}"
        self._prefix = prefix
        self._workers = []
        try:
            for rank in range(self.world_size):
                parent_end, child_end = context.Pipe()
                process = context.Process(
                    target=_worker_main, name=f"distframe-{self.backend}-rank{rank}", daemon=True,
                    args=(rank, self.world_size, self.backend, host, port, prefix, self.timeout,
                          self._backend_kwargs, child_end, list(sys.path), dict(os.environ), os.getpid()))
                process.start()
                child_end.close()
                self._workers.append(_Worker(rank, process, parent_end))
        except BaseException:  # Ctrl-C while the forkserver starts: the workers started go too
            self._stop_workers(graceful=False)
            self._needs_restart = True
            raise
        self._needs_restart = False
        _, errors = self._collect()  # each worker reports once its backend is built
        if errors:
            self._stop_workers(graceful=False)
            raise_first_failure(errors)

    def _collect(self) -> tuple[list, dict[int, BaseException]]:
        results: list[Any] = [None] * self.world_size
        errors: dict[int, BaseException] = {}
        pending = {w.rank: w for w in self._workers}
        p2p_counts: list[dict | None] = [None] * self.world_size
        deadline: float | None = None
        try:
            while pending:
                wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
                handles = [h for w in pending.values() for h in (w.connection, w.process.sentinel)]
                multiprocessing.connection.wait(handles, timeout=wait_s)
                for rank, worker in list(pending.items()):
                    outcome = worker.poll()
                    if outcome is None:
                        continue
                    del pending[rank]
                    ok, value, failed, p2p_counts[rank] = outcome
                    self._needs_restart |= failed
                    if ok:
                        results[rank] = value
                    else:
                        errors[rank] = value
                if errors and deadline is None:
                    deadline = time.monotonic() + _GRACE_S
                if deadline is not None and time.monotonic() >= deadline and pending:
                    break
        except BaseException:  # Ctrl-C in the caller: no worker is left running
            self._stop_workers(graceful=False)
            self._needs_restart = True
            raise
        if pending:
            first = min(errors)
            for rank in pending:
                errors[rank] = RankFailedError(first, f"rank {rank} was stopped because rank "
                                                      f"{first} failed")
            self._stop_workers(graceful=False)
            self._needs_restart = True
        if errors and messages_unmatched(p2p_counts):
            self._needs_restart = True
        return results, errors

    def _stop_workers(self, *, graceful: bool) -> None:
        workers, self._workers = self._workers, []
        for worker in workers:
            if graceful and worker.process.is_alive():
                try:
                    worker.connection.send_bytes(b"")  # the stop message
                except OSError:
                    pass
            else:
                worker.process.terminate()
        deadline = time.monotonic() + (_STOP_S if graceful else 2.0)
        for worker in workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.connection.close()


class _Worker:
    """The parent's handle on one rank's process."""

    def __init__(self, rank: int, process: multiprocessing.Process,
                 connection: multiprocessing.connection.Connection) -> None:
        self.rank, self.process, self.connection = rank, process, connection

    def poll(self) -> tuple[bool, Any, bool, dict | None] | None:
        """``(ok, result or exception, backend failed, its point-to-point counts)`` once this
        rank has answered or died (counts None then)."""
        try:
            if self.connection.poll():
                return _decode_reply(self.connection.recv_bytes(), self.rank)
        except (EOFError, OSError):
            pass
        if self.process.is_alive():
            return None
        return False, process_exited(self.rank, f"its process exited with code {self.process.exitcode} "
                                                "before answering"), True, None


# ---- the worker side ---------------------------------------------------------------------------
def _start_context(start_method: str) -> Any:
    if start_method == "forkserver" and "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        # Takes effect when the server starts (once per process); it imports torch, nothing more.
        context.set_forkserver_preload(["distframe._process_launch", "torch.distributed"])
        _start_forkserver_deaf_to_ctrl_c()
        return context
    return multiprocessing.get_context("spawn")


def _start_forkserver_deaf_to_ctrl_c() -> None:
    """[Note: the forkserver and Ctrl-C] The forkserver imports its preloads (torch: seconds)
    before it ignores SIGINT itself, and it is in the terminal's process group: a Ctrl-C in the
    first seconds of a run printed its KeyboardInterrupt traceback under distframe's one line.
    Started with SIGINT ignored (a disposition exec keeps, and Python then leaves alone), it never
    sees one; its children, the rank processes, get Python's handler back (``_worker_main``). The
    parent's own handler is back at once. From the main thread only (signal.signal's rule):
    elsewhere the server starts on the first worker's start, as before."""
    import threading
    from multiprocessing import forkserver
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


def _worker_main(rank: int, world_size: int, engine: str, host: str, port: int, prefix: str,
                 timeout: float, backend_kwargs: dict, connection: Any, sys_path: list[str],
                 environ: dict[str, str], launcher_pid: int | None = None) -> None:
    watch_launcher(launcher_pid)  # [distframe._launcher_watch]
    # Forked from a forkserver that ignores SIGINT ([Note: the forkserver and Ctrl-C]).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # A forkserver child inherits the server's view, taken when it started: use the caller's.
    sys.path[:] = sys_path
    os.environ.clear()
    os.environ.update(environ)
    try:
        backend = _build_backend(rank, world_size, engine, host, port, prefix, timeout, backend_kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        connection.send_bytes(_encode_error(exc, failed=True))
        return
    connection.send_bytes(pickle.dumps((True, None, False, {})))
    try:
        while True:
            try:
                task = connection.recv_bytes()
            except (EOFError, OSError):  # the parent has gone
                return
            if not task:
                return
            connection.send_bytes(_run_task(backend, task))
    finally:
        backend.shutdown()


def _build_backend(rank: int, world_size: int, engine: str, host: str, port: int, prefix: str,
                   timeout: float, backend_kwargs: dict) -> Any:
    import torch.distributed as dist

    from distframe.backends.torch_dist import GlooCommunicationBackend, NCCLCommunicationBackend
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    kwargs = dict(backend_kwargs)
    if engine == "nccl":
        kwargs.setdefault("device", rank)
        return NCCLCommunicationBackend(rank, world_size, store, timeout=timeout, prefix=prefix, **kwargs)
    kwargs.setdefault("hostname", "127.0.0.1")  # every rank is on this machine
    return GlooCommunicationBackend(rank, world_size, store, timeout=timeout, prefix=prefix, **kwargs)


def _run_task(backend: Any, task: bytes) -> bytes:
    try:
        try:
            fn, args, kwargs = pickle.loads(task)
        except (AttributeError, ImportError) as exc:  # pickled by name, not found here
            raise unimportable_task(exc) from exc
        result = fn(backend, *args, **kwargs)
        # An asynchronous call never waited for ends with the function (as it would with
        # spawn's shutdown): its failure is this run's, not the next run's first call's.
        backend._drain()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        backend.depart(failed=True)
        failed = _drain_after_failure(backend, exc)
        return _encode_error(exc, failed=failed or _has_failed(backend) or isinstance(
            exc, (CollectiveTimeoutError, RankFailedError)), p2p_counts=p2p_counts(backend))
    backend.depart()  # [Note: departures between runs]
    try:
        return pickle.dumps((True, result, _has_failed(backend), p2p_counts(backend)))
    except Exception as exc:  # noqa: BLE001 - the function ran: say that its result cannot travel
        return _encode_error(unpicklable_result(fn, result, exc), failed=_has_failed(backend),
                             p2p_counts=p2p_counts(backend))


def _drain_after_failure(backend: Any, exc: BaseException) -> bool:
    """Waits for the asynchronous calls that a raising function left pending, after departing (so
    peers that never make them stop at once). True when one failed: this rank then made calls its
    peers did not, the group is out of step, and the next run gets fresh workers instead of
    meeting the failure in its first call."""
    try:
        backend._drain()
    except BaseException as error:  # noqa: BLE001 - reported as a note on the function's error
        exc.add_note(f"An asynchronous call it left pending failed too: {type(error).__name__}: {error}")
        return True
    return False


def _has_failed(backend: Any) -> bool:
    return bool(getattr(backend, "has_failed", False))


# ---- exceptions across the pipe -------------------------------------------------------------------
def _encode_error(exc: BaseException, *, failed: bool, p2p_counts: dict | None = None) -> bytes:
    """Exceptions whose __init__ takes other arguments than ``args`` (most of distframe.errors)
    do not survive pickle, so the class, ``args`` and attributes travel separately."""
    remote = "".join(traceback.format_exception(exc)).rstrip()
    try:
        state = pickle.dumps((type(exc), exc.args, dict(vars(exc))))
    except Exception:  # noqa: BLE001 - an unpicklable argument: keep the text
        state = pickle.dumps((RuntimeError, (f"{type(exc).__name__}: {exc}",), {}))
    return pickle.dumps((False, (state, remote), failed, p2p_counts))


def _decode_reply(reply: bytes, rank: int) -> tuple[bool, Any, bool, dict | None]:
    try:
        ok, value, failed, p2p_counts = pickle.loads(reply)
    except Exception as exc:  # noqa: BLE001 - e.g. the result's class is not importable here
        return False, RuntimeError(f"rank {rank}'s reply could not be unpickled: {exc!r}"), False, None
    if ok:
        return ok, value, failed, p2p_counts
    state, remote = value
    try:
        cls, args, attributes = pickle.loads(state)
        exc = rebuild_exception(cls, args, attributes)
    except Exception:  # noqa: BLE001
        exc = RuntimeError(remote.splitlines()[-1] if remote else "unknown error")
    exc.add_note(f"Traceback on rank {rank}:\n{remote}")
    return False, exc, failed, p2p_counts
