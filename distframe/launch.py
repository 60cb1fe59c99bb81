"""How ranks come to exist: ``spawn`` (threads or processes from one Python call) and
``init_backend`` (a process started by mpirun/mpiexec or torchrun).

[Note: the script is the rank's function] Under spawn a rank departs when its function returns
(``distframe.backends.departures``). Under a launcher the script is the function: a backend from
``init_backend`` departs when the main thread has finished the script (as failed if it raised),
even while other threads keep the process alive, so peers still waiting for it in a call it never
made stop at once. A thread that goes on calling collectives after the script has ended is not
supported: it would be seen as departed. Besides, a backend departs when it is garbage or when
the interpreter exits (shutdown() departs too).
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from distframe.backends.base import DEFAULT_TIMEOUT
from distframe.backends.inmemory import InMemoryCommunicationBackend
from distframe.backends.validation import check_timeout
from distframe.errors import BackendUnavailableError, ConfigError, RankFailedError

T = TypeVar("T")
ENGINES = ("inmemory", "gloo", "nccl", "mpi")


def spawn(fn: Callable[..., T], world_size: int, backend: str = "inmemory", *,
          timeout: float = DEFAULT_TIMEOUT, **backend_kwargs: Any) -> list[T]:
    """Runs ``fn(backend)`` on ``world_size`` ranks and returns each rank's result, in rank order.

    ``inmemory`` ranks are threads of this process; ``gloo`` and ``nccl`` ranks are spawned
    processes (``fn`` and its results must pickle; ``nccl`` needs one GPU per rank); ``mpi`` ranks
    are processes started with ``mpiexec``. ``timeout`` and ``backend_kwargs`` go to each backend's
    constructor. If any rank raises, the others stop (in-memory: at once, with RankFailedError;
    processes: those waiting for it in a call with RankFailedError, the others are terminated),
    every thread or process has ended when ``spawn`` returns, and the first original exception is
    re-raised with a note naming its rank. Ranks that wait for a rank whose function has returned
    stop at once with CollectiveTimeoutError (Gloo and MPI ranks: within a fraction of a second;
    see distframe.backends.departures for what NCCL and MPI ranks on other nodes see).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
    timeout = check_timeout(timeout)  # here, not once per rank (and before any process starts)
    if backend == "inmemory":
        return _spawn_threads(fn, world_size, timeout=timeout, **backend_kwargs)
    if backend in ("gloo", "nccl"):
        from distframe._process_launch import spawn_processes
        return spawn_processes(fn, world_size, backend, timeout=timeout, **backend_kwargs)
    if backend == "mpi":
        from distframe._mpi_launch import spawn_mpi
        return spawn_mpi(fn, world_size, timeout=timeout, **backend_kwargs)
    raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(ENGINES)}")


def _spawn_threads(fn: Callable[..., T], world_size: int, **backend_kwargs: Any) -> list[T]:
    backends = InMemoryCommunicationBackend.create_group(world_size, **backend_kwargs)
    results, errors = [None] * world_size, {}
    threads = start_rank_threads(backends, fn, results, errors, "distframe-rank")
    try:
        for t in threads:
            t.join()
    except BaseException as exc:  # Ctrl-C in the caller: stop every rank, then re-raise.
        backends[0].world.abort(-1, exc)
        wait_for_ranks(threads, 5)
        raise
    if errors:
        raise_first_failure(errors)
    return results


def start_rank_threads(backends: list[InMemoryCommunicationBackend], fn: Callable[[Any], Any],
                       results: list[Any], errors: dict[int, BaseException],
                       name: str) -> list[threading.Thread]:
    """Starts one daemon thread per in-memory rank running ``fn(backends[rank])``: its result goes
    to ``results[rank]``, what it raises to ``errors[rank]`` (and aborts the group, so peers stop
    at once). Either way the rank then finishes: its backends, subgroups included, shut down, so
    peers still waiting for it in a call it never made stop at once; an asynchronous call that
    failed unseen is its error then. The caller joins the threads (spawn, the elastic controller);
    if one cannot start, those started are stopped and joined before the error is raised."""
    finished = [threading.Event() for _ in backends]

    def run(rank: int) -> None:
        backend = backends[rank]
        try:
            results[rank] = fn(backend)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors[rank] = exc
            backend.world.abort(rank, exc)
        finally:
            try:
                backend.world.finish(rank)
            except BaseException as exc:  # noqa: BLE001 - an asynchronous call that failed unseen
                errors.setdefault(rank, exc)
            finally:
                finished[rank].set()

    threads = [threading.Thread(target=run, args=(r,), name=f"{name}{r}", daemon=True)
               for r in range(len(backends))]
    for thread, event in zip(threads, finished):
        thread.finished = event  # type: ignore[attr-defined] - see wait_for_ranks
    try:
        for t in threads:
            t.start()
    except BaseException as exc:
        # No thread for a rank ("can't start new thread"), or Ctrl-C: the ranks started would
        # wait for it until their timeout, after the caller has seen the error. Stop them now
        # (a thread that Ctrl-C interrupted in start() may have started: it has an ident).
        backends[0].world.abort(-1, exc)
        wait_for_ranks([t for t in threads if t.ident is not None], 5)
        raise
    return threads


def wait_for_ranks(threads: list[threading.Thread], timeout: float) -> None:
    """Waits up to ``timeout`` seconds for each rank thread of ``start_rank_threads`` to finish.
    Not ``Thread.join``: once a join was interrupted (Ctrl-C in the caller), Python 3.11's
    ``is_alive()`` reads False for a thread still running, and a second join returns at once, so
    spawn returned with a rank still computing and the interpreter aborted at exit (status 134)."""
    for thread in threads:
        thread.finished.wait(timeout)  # type: ignore[attr-defined]


def p2p_counts(backend: Any) -> dict[tuple[str, int, int], int]:
    """The backend's messages sent and received so far, per (direction, peer, tag)."""
    return dict(backend._p2p_seq)


def messages_unmatched(counts: list[dict | None]) -> bool:
    """Whether, after a run, some rank's count of messages sent to (received from) a peer on a
    tag differs from that peer's count of those received from (sent to) it, or a rank's counts
    are unknown: a message then waits unreceived, or a receive stays posted, for the next run."""
    for rank, mine in enumerate(counts):
        if mine is None:
            return True
        for (direction, peer, tag), count in mine.items():
            theirs = counts[peer]
            opposite = "recv" if direction == "send" else "send"
            if theirs is None or theirs.get((opposite, rank, tag), 0) != count:
                return True
    return False


def raise_first_failure(errors: dict[int, BaseException]) -> None:
    """Re-raises the original failure (not a peer's RankFailedError), noting which rank raised it;
    a rank's ``sys.exit`` is raised as RankFailedError (from the SystemExit). Where every rank
    reports a RankFailedError, the launcher's own for a rank whose process died (naming that rank)
    comes first: its peers' may name the wrong one (a dead process leaves no word)."""
    originals = {r: e for r, e in errors.items() if not isinstance(e, RankFailedError)}
    died = {r: e for r, e in errors.items() if getattr(e, "process_exited", False)}
    rank, exc = min((originals or died or errors).items())
    note = f"(raised on rank {rank}; {len(errors)} of the ranks failed)"
    if isinstance(exc, SystemExit):
        # Re-raised as it is, a rank's sys.exit would end the calling program without a word,
        # with that rank's status: sys.exit(0) on one rank passed a failed run off as a success.
        failure = RankFailedError(rank, f"its function called sys.exit({exc.code!r}) instead of "
                                        "returning; return a value, or raise an exception, instead")
        failure.add_note(note)
        raise failure from exc
    exc.add_note(note)
    raise exc


def process_exited(rank: int, detail: str) -> RankFailedError:
    """The launcher's error for rank ``rank``, whose process ended without answering: marked, so
    ``raise_first_failure`` reports it before its peers' RankFailedErrors, which may name another
    rank (a subgroup's numbering, or the sender a receive waited for)."""
    error = RankFailedError(rank, detail)
    error.process_exited = True
    return error


def unpicklable_result(fn: Any, result: Any, error: Exception) -> TypeError:
    """The error a rank process reports when ``fn``'s result cannot be pickled back to the caller."""
    return TypeError(f"{getattr(fn, '__qualname__', fn)!r} returned a {type(result).__name__} that "
                     f"cannot be pickled back to the caller ({type(error).__name__}: {error}); return "
                     "tensors, numbers, strings or containers of them instead")


def unimportable_task(error: AttributeError | ImportError) -> BaseException:
    """``error``, raised in a rank process unpickling the function spawn was given (or an
    argument of it), of the same class, with what to do added to its message."""
    return type(error)(
        f"{error}: a rank process imports the function spawn runs by name, so it must be defined at "
        "the top level of a module (not inside a function, nor under `if __name__ == \"__main__\":`, "
        "which a rank process does not run); pass it arguments with functools.partial(fn, ...)")


_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
_MPI_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID")
LAUNCHER_COMMANDS = {"mpi": "mpiexec", "torchrun": "torchrun"}  # what a message tells the user to run


def detect_launcher(environ: dict[str, str] | None = None) -> str | None:
    """'mpi' under mpirun/mpiexec, 'torchrun' under torchrun, None otherwise. torchrun's variables
    win: a torchrun per node started by mpirun or srun (a common cluster layout) passes the MPI
    launcher's on to its workers, which MPI_Init would then fail on or take as a world of one.
    RANK or WORLD_SIZE without the rest of torchrun's variables (and no MPI launcher's) is a
    ConfigError: taken for no launcher, each process trained a whole run of its own into one
    --out. MASTER_ADDR alone is no launcher (job scripts export it for other tools too)."""
    env = os.environ if environ is None else environ
    if all(k in env for k in _TORCHRUN_VARIABLES):
        return "torchrun"
    if any(k in env for k in _MPI_VARIABLES):
        return "mpi"
    if "RANK" in env or "WORLD_SIZE" in env:
        given = [k for k in _TORCHRUN_VARIABLES if k in env]
        missing = [k for k in _TORCHRUN_VARIABLES if k not in env]
        raise ConfigError(f"{', '.join(given)} set but {', '.join(missing)} not set: start the program "
                          "with torchrun, or set all of RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
                          "(none of them to train without a launcher)")
    return None


def start_mpi() -> Any:
    """MPI_COMM_WORLD, MPI started (None without an MPI library): for a rank of an mpiexec job
    that leaves before its backend has started, whose peers would wait in MPI_Init (which has no
    timeout) for ever. Its start completes their MPI_Init; its ``Abort`` then ends them all."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError):  # no MPI library here: the peers have none either
        return None
    return MPI.COMM_WORLD


def init_backend(name: str = "auto", *, timeout: float = DEFAULT_TIMEOUT, **backend_kwargs: Any):
    """The backend of a process that a launcher started.

    ``auto``: MPI under mpirun/mpiexec; under torchrun NCCL when every process on this node can
    have a GPU of its own (NCCL refuses two ranks on one GPU), else Gloo; otherwise a single-rank
    in-memory group. ``mpi``, ``gloo``, ``nccl`` and ``inmemory`` force one.
    """
    launcher = detect_launcher()
    if name == "auto":
        name = auto_backend_name(launcher)
    if name == "inmemory":
        return InMemoryCommunicationBackend(0, 1, timeout=timeout, **backend_kwargs)
    if name == "mpi":
        from distframe.backends.mpi import MPICommunicationBackend
        return _departs_with_script(MPICommunicationBackend(timeout=timeout, **backend_kwargs))
    if name in ("gloo", "nccl"):
        if launcher != "torchrun":
            raise BackendUnavailableError(
                f"backend {name!r} needs RANK, WORLD_SIZE and MASTER_ADDR: start the program with "
                f"torchrun, or use spawn(fn, world_size, backend={name!r})")
        from distframe.backends.torch_dist import from_environment
        return _departs_with_script(from_environment(name, timeout=timeout, **backend_kwargs))
    raise ConfigError(f"unknown backend {name!r}; choose auto or one of {', '.join(ENGINES)}")


def auto_backend_name(launcher: str | None) -> str:
    """The engine ``init_backend("auto")`` builds under ``launcher`` (``detect_launcher()``):
    MPI under mpirun/mpiexec; under torchrun NCCL when every process on this node can have a GPU
    of its own (NCCL refuses two ranks on one GPU), else Gloo; in-memory without a launcher."""
    if launcher == "mpi":
        return "mpi"
    if launcher == "torchrun":
        from distframe.backends.torch_dist import visible_gpus
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return "nccl" if visible_gpus() >= local_ranks else "gloo"
    return "inmemory"


_script_backends: weakref.WeakSet = weakref.WeakSet()
_script_watcher: threading.Thread | None = None


def _departs_with_script(backend: T) -> T:
    """[Note: the script is the rank's function]: one daemon thread per process waits for the main
    thread to finish, then departs every backend ``init_backend`` made that is still open."""
    global _script_watcher
    _script_backends.add(backend)
    if _script_watcher is None:
        _script_watcher = threading.Thread(target=_depart_after_script, name="distframe-script-end",
                                           daemon=True)
        _script_watcher.start()
        atexit.register(_shut_down_at_exit)
    return backend


def _shut_down_at_exit() -> None:
    """At interpreter exit (after every non-daemon thread has ended, so nothing calls them any
    more), shuts down what the script left open: a Gloo process group destroyed only by the
    interpreter's teardown aborted the process now and then ("terminate called without an
    active exception", 3 exits in 12 under load), which torchrun reports as the rank failing."""
    # The watcher thread does not get to run after an uncaught exception in the script, so the
    # departure is told here too: as failed when the script raised (sys.last_value is set then),
    # so peers raise RankFailedError rather than hear that it returned.
    failed = getattr(sys, "last_value", None) is not None
    for backend in list(_script_backends):
        if not backend.is_shut_down:
            try:
                backend.depart(failed=failed)
                backend.shutdown()
            except Exception:  # noqa: BLE001 - exiting anyway; the peers were told it departed
                pass
    retiring = sys.modules.get("distframe.backends.mpi_retire")  # imported where MPI was used
    if retiring is not None:
        retiring.settle_at_exit()


def _depart_after_script() -> None:
    threading.main_thread().join()  # returns once the script has ended, before threads are joined
    failed = getattr(sys, "last_value", None) is not None  # set when the script raised
    for backend in list(_script_backends):
        if not backend.is_shut_down:
            backend.depart(failed=failed)
