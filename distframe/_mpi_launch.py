"""Running Python functions on MPI ranks from one ordinary process: ``spawn_mpi`` and ``MPIPool``.

The parent starts ``mpiexec -n N python -m distframe._mpi_launch HOST PORT`` once. Every rank
connects back to the parent over a local socket (``multiprocessing.connection``, authenticated
with a random key passed in the environment) and then loops: receive a pickled task, build an
``MPICommunicationBackend`` over a fresh duplicate of ``COMM_WORLD``, run ``fn(backend, *args,
**kwargs)``, shut the backend down, send the result or the exception back. Shutting down departs
(``distframe.backends.departures``): peers still waiting for the rank in a call stop at once.
Tasks go to each rank over its own connection rather than by MPI broadcast, so the parent learns
at once when a rank fails and never depends on the MPI state that a failure may have left behind.

If a rank fails and its peers have not reported within ``FAILURE_GRACE_SECONDS`` (typically
they wait inside a collective for the failed rank), or a rank dies, the parent kills the whole
job (its own process group), raises the first failure with a note naming its rank, and starts a
fresh job on the next ``run``. A job whose ranks have all answered is ended normally, even when
the run failed, so that MPI removes its shared memory; after a kill the parent removes it
([Note: MPICH's segments after a kill] in ``_mpi_segments``). A run whose ranks all returned
still fails if some rank completed a collective that a peer never made
([Note: calls a peer never made] in ``distframe.backends.mpi``).
"""
from __future__ import annotations

import importlib
import io
import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
import types
from collections.abc import Callable
from multiprocessing import connection
from typing import Any

from distframe._launcher_watch import PID_ENV, watch_launcher
from distframe._mpi_segments import mapped_segments, remove_segments, unlink_own_segments
from distframe.backends.base import DEFAULT_TIMEOUT
from distframe.errors import BackendUnavailableError, ConfigError, RankFailedError

FAILURE_GRACE_SECONDS = 1.0
STARTUP_SECONDS = 120.0
_AUTHKEY_ENV = "DISTFRAME_MPI_AUTHKEY"
_INSTALL_HINT = "install it with `pip install 'distframe[mpi]'` (or `pip install mpi4py mpich`)"


def spawn_mpi(fn: Callable[..., Any], world_size: int, *, timeout: float = DEFAULT_TIMEOUT,
              **backend_kwargs: Any) -> list[Any]:
    """Runs ``fn(backend)`` on ``world_size`` MPI ranks (one mpiexec job, ended before this
    returns) and returns each rank's result in rank order; see ``distframe.launch.spawn``."""
    with MPIPool(world_size, timeout=timeout, **backend_kwargs) as pool:
        return pool.run(fn)


def find_mpiexec() -> str:
    """mpiexec next to this Python (a virtual environment with the mpich wheel), else on PATH."""
    try:
        importlib.import_module("mpi4py")
    except ImportError as exc:
        raise BackendUnavailableError(f"the MPI backend needs mpi4py ({exc}); {_INSTALL_HINT}") from exc
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")
    if found is None:
        raise BackendUnavailableError(f"no mpiexec next to {sys.executable} or on PATH; {_INSTALL_HINT}")
    return found


class MPIPool:
    """A persistent mpiexec job of ``world_size`` ranks that runs functions on every rank.

    ``run(fn, *args, **kwargs)`` calls ``fn(backend, *args, **kwargs)`` on every rank, where
    ``backend`` is a new ``MPICommunicationBackend(timeout=timeout, **backend_kwargs)`` for that
    run, and returns the results in rank order. ``fn`` is pickled by reference, so it must be
    importable (a module-level function); the ranks see this process's ``sys.path``, but not its
    ``__main__``, so a function or class defined there (in ``fn``, a partial or an argument) is a
    ``ConfigError`` before anything runs.
    ``run_timeout`` (seconds, default none) bounds a whole run from the parent's side.
    """

    def __init__(self, world_size: int, *, timeout: float = DEFAULT_TIMEOUT,
                 run_timeout: float | None = None, **backend_kwargs: Any) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.timeout = timeout
        self.run_timeout = run_timeout
        self.backend_kwargs = backend_kwargs
        self._mpiexec = find_mpiexec()
        self._job: _Job | None = None
        self._closed = False
        self._job = _Job(self._mpiexec, world_size)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        if self._closed:
            raise ValueError("MPIPool.run called after close(); create a new pool")
        payload = _dumps_for_ranks((fn, args, kwargs, self.timeout, self.backend_kwargs), fn)
        if self._job is None or not self._job.usable:
            if self._job is not None:
                self._job.close()  # idle, or ended already: close() kills it if it does not exit
            self._job = _Job(self._mpiexec, self.world_size)
        return self._job.run(payload, self.run_timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._job is not None:
            self._job.close()
            self._job = None

    def __enter__(self) -> MPIPool:
        return self

    def __exit__(self, exc_type: Any, *exc_info: Any) -> None:
        interrupted = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
        if self._job is not None and (interrupted or self._job.busy):
            # Ranks busy in a run would not read close()'s shutdown message, and Ctrl-C should not
            # wait for them to finalize: end them now. Otherwise (a rank raised, run() refused the
            # function) the ranks are idle: close() ends them normally, and MPI cleans up.
            self._job.kill()
            self._job = None
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and getattr(self, "_job", None) is not None:
            self._job.kill()


class _Job:
    """One mpiexec process group and a connection to each of its ranks."""

    def __init__(self, mpiexec: str, world_size: int) -> None:
        self.world_size = world_size
        self.usable = False
        self.busy = False  # a run was sent and not every rank has answered
        self.rank_pids: list[int] = []
        self.segments: set[str] = set()  # MPICH's shared memory, removed after a kill
        authkey = secrets.token_bytes(32)
        server = socket.create_server(("127.0.0.1", 0))
        env = dict(os.environ)
        env[_AUTHKEY_ENV] = authkey.hex()
        # Ranks import fn by reference: give them this process's import path (tests.* included).
        paths = [os.getcwd(), *(p for p in sys.path if p)]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env[PID_ENV] = str(os.getpid())  # the ranks end if this process dies (_launcher_watch)
        env.setdefault("UCX_LOG_LEVEL", "error")  # UCX warns about MPI windows at exit otherwise
        host, port = server.getsockname()[:2]
        self.process = subprocess.Popen(
            [mpiexec, "-n", str(world_size), sys.executable, "-m", "distframe._mpi_launch", host, str(port)],
            env=env, start_new_session=True)
        try:
            self.conns = self._accept(server, authkey)
        except BaseException:
            self.kill()
            raise
        finally:
            server.close()
        self.usable = True

    def _accept(self, server: socket.socket, authkey: bytes) -> list[connection.Connection]:
        conns: dict[int, connection.Connection] = {}
        deadline = time.monotonic() + STARTUP_SECONDS
        server.settimeout(0.2)
        while len(conns) < self.world_size:
            if self.process.poll() is not None:
                raise RankFailedError(None, f"mpiexec exited with status {self.process.returncode} "
                                            "before every rank connected")
            if time.monotonic() > deadline:
                raise BackendUnavailableError(f"mpiexec did not start {self.world_size} ranks within "
                                              f"{STARTUP_SECONDS:g} s")
            try:
                sock, _ = server.accept()
            except TimeoutError:
                continue
            sock.settimeout(None)
            conn = connection.Connection(sock.detach())
            connection.deliver_challenge(conn, authkey)
            connection.answer_challenge(conn, authkey)
            rank, failure, (pid, segments) = conn.recv()
            self.rank_pids.append(pid)
            self.segments.update(segments)
            if failure is not None:
                raise _restore_exception(failure)
            if rank in conns:
                raise BackendUnavailableError(
                    f"two of the {self.world_size} ranks that {self.process.args[0]} started are rank "
                    f"{rank} of MPI_COMM_WORLD: its MPI is not the one mpi4py loaded")
            conns[rank] = conn
        return [conns[r] for r in range(self.world_size)]

    def run(self, payload: bytes, run_timeout: float | None) -> list[Any]:
        self.usable = False  # until every rank has answered
        self.busy = True
        for conn in self.conns:
            conn.send_bytes(payload)
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        deadline = None if run_timeout is None else time.monotonic() + run_timeout
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        dead: list[int] = []
        counts: list[dict | None] = [None] * self.world_size
        calls: list[tuple | None] = [None] * self.world_size
        while waiting:
            if errors:
                grace = time.monotonic() + FAILURE_GRACE_SECONDS
                deadline = grace if deadline is None else min(deadline, grace)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = connection.wait(list(waiting), timeout=left)
            if not ready:
                break
            for conn in ready:
                rank = waiting.pop(conn)
                try:
                    ok, value, counts[rank], calls[rank] = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    # mpiexec ends every rank once one dies: only the first to go is the cause.
                    if not dead:
                        from distframe.launch import process_exited
                        errors[rank] = process_exited(rank, "its process exited during the run")
                    dead.append(rank)
                    continue
                if ok:
                    results[rank] = value
                else:
                    errors[rank] = _restore_exception(value)
        self.busy = False
        if waiting or dead:
            self.kill()  # unresponsive, or being ended by mpiexec (a rank died)
            if waiting and not errors:
                raise TimeoutError(f"MPIPool.run did not finish within {run_timeout:g} s; ranks "
                                   f"{sorted(waiting.values())} were still running (job killed)")
        else:
            # A run in which a rank raised may leave a message unreceived (or a receive posted):
            # it would reach the next run's receive on that channel, even over a fresh Dup of
            # COMM_WORLD (seen with MPICH; likely its reuse of a freed communicator's context id),
            # so a fresh job then.
            from distframe.launch import messages_unmatched
            self.usable = not (errors and messages_unmatched(counts))
            # A rank may have completed a rooted collective that a peer, which returned, never made
            # ([Note: calls a peer never made] in distframe.backends.mpi): that is its error.
            from distframe.backends.departures import skipped_call_errors
            errors.update(skipped_call_errors(calls, errors))
        if errors:
            from distframe.launch import raise_first_failure
            raise_first_failure(errors)
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        for conn in getattr(self, "conns", []):
            try:
                conn.send_bytes(b"")
                conn.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            return
        if self.process.returncode != 0:  # mpiexec ended the ranks (one died): nothing finalized
            remove_segments(self.segments, self.rank_pids)

    def kill(self) -> None:
        self.usable = self.busy = False
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
        for conn in getattr(self, "conns", []):
            conn.close()
        remove_segments(self.segments, self.rank_pids)


def _dumps_for_ranks(task: Any, fn: Callable[..., Any]) -> bytes:
    """``pickle.dumps(task)``, refusing what the ranks could not unpickle because it is defined in
    the caller's ``__main__``: they run ``python -m distframe._mpi_launch``, so their ``__main__``
    is another module. Every function and class pickled by reference is checked, wherever it sits:
    ``fn`` itself, a ``functools.partial`` of it, an argument or an argument's class."""
    buffer = io.BytesIO()
    _RankPickler(buffer, fn).dump(task)
    return buffer.getvalue()


class _RankPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, fn: Callable[..., Any]) -> None:
        super().__init__(file)
        self._fn = fn

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (types.FunctionType, type)) and getattr(obj, "__module__", None) == "__main__":
            what = repr(obj) if obj is self._fn else f"{obj!r} (in {self._fn!r} or its arguments)"
            raise ConfigError(f"MPIPool.run: {what} is defined in the __main__ script, which the ranks "
                              "cannot import; move it to a module and import it from there")
        return NotImplemented  # pickle it as usual


# ---- exceptions across processes ------------------------------------------------------------------
def _portable_exception(exc: BaseException) -> Any:
    """What the parent needs to rebuild ``exc``: distframe's errors take several constructor
    arguments but keep only the message in ``args``, so they do not round-trip through pickle."""
    text = "".join(traceback.format_exception(exc))
    state = (type(exc), exc.args, dict(vars(exc)), text)
    try:
        pickle.dumps(state)
        return state
    except Exception:  # noqa: BLE001 - an unpicklable exception travels as text
        return (RuntimeError, (f"{type(exc).__name__}: {exc}",), {}, text)


def _restore_exception(state: Any) -> BaseException:
    from distframe.errors import rebuild_exception
    cls, args, attributes, text = state
    exc = rebuild_exception(cls, args, attributes)
    exc.add_note("remote traceback:\n" + text.rstrip())
    return exc


# ---- the rank side ------------------------------------------------------------------------------
def _wait_for_parent(conn: connection.Connection) -> None:
    try:
        while True:
            conn.recv_bytes()
    except (EOFError, OSError):
        os._exit(1)


def _serve(host: str, port: int) -> None:
    from distframe.backends.mpi import MPICommunicationBackend
    from distframe.backends.mpi_buffers import import_mpi

    launcher = os.environ.pop(PID_ENV, None)
    watch_launcher(None if launcher is None else int(launcher))
    # MPI first: the parent handshakes with one rank at a time and then waits for its message, so
    # a rank that connected before MPI_Init could wait there for a peer the parent has not let in.
    try:
        MPI = import_mpi()
        rank, failure = MPI.COMM_WORLD.Get_rank(), None
    except BaseException as exc:  # noqa: BLE001 - e.g. another MPI's mpiexec: the parent raises it
        rank, failure = None, exc
        unlink_own_segments()  # the job will be killed: MPI_Init's segment (a singleton's) goes now
    conn = connection.Client((host, port), authkey=bytes.fromhex(os.environ.pop(_AUTHKEY_ENV)))
    if failure is not None:
        conn.send((None, _portable_exception(failure), (os.getpid(), [])))
        _wait_for_parent(conn)  # which ends the job; exiting first could end it before the send lands
    conn.send((rank, None, (os.getpid(), sorted(mapped_segments()))))  # after MPI_Init made them
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(1)  # the parent is gone: do not wait in MPI_Finalize for anyone
        if not payload:
            # Finalize, then skip the interpreter's teardown (torch's takes seconds).
            sys.stdout.flush()
            sys.stderr.flush()
            MPI.Finalize()
            os._exit(0)
        backend = None
        try:
            fn, args, kwargs, timeout, backend_kwargs = pickle.loads(payload)
            with MPICommunicationBackend(timeout=timeout, **backend_kwargs) as backend:
                try:
                    reply = (True, fn(backend, *args, **kwargs))
                except BaseException:
                    # Peers waiting for this rank stop with RankFailedError, which the parent
                    # ranks below this error; shutdown would depart as if fn had returned.
                    backend.depart(failed=True)
                    raise
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            reply = (False, _portable_exception(exc))
        # The parent compares every rank's message counts after a failed run, and the calls they
        # made after every run (see _Job.run).
        from distframe.launch import p2p_counts
        reply = (*reply, *((None, None) if backend is None
                           else (p2p_counts(backend), backend.calls_not_seen_made())))
        # Plain pickle, not Connection.send: torch registers reducers with multiprocessing's
        # pickler that pass tensors as shared file descriptors, which this channel cannot carry.
        try:
            data = pickle.dumps(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. a result that does not pickle
            from distframe.launch import unpicklable_result
            failure = _portable_exception(unpicklable_result(fn, reply[1], exc))
            data = pickle.dumps((False, failure, *reply[2:]))
        conn.send_bytes(data)


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
