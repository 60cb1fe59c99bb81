"""``distframe train``: how the ranks of a training run come to exist.

``run(config)`` either spawns ``config.world_size`` ranks itself (in-memory threads, Gloo or NCCL
processes, or an mpiexec job) or, in a process that mpiexec/mpirun or torchrun started, joins the
launcher's world; every rank then runs ``distframe.train_loop.train_on_rank``.
``--optimizer elastic`` runs ``distframe.train_elastic.run_elastic`` instead, which starts and
restarts in-memory workers itself. Problems a user can fix (an engine that cannot run here,
unusable data) are raised as ConfigError or BackendUnavailableError before any rank starts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from distframe import train_checkpoint
from distframe.checkpoint.agreement import agree
from distframe.checkpoint.format import CheckpointError
from distframe.cli import BAD_INPUT_ERRORS, RANK_0_REPORT_WAIT
from distframe.data import check_windows
from distframe.errors import BackendUnavailableError, ConfigError
from distframe.launch import LAUNCHER_COMMANDS, auto_backend_name, detect_launcher, init_backend, spawn
from distframe.train_config import DEFAULT_WORLD_SIZE, TrainConfig, timeout_of
from distframe.train_settings import check_resumed_model, restarted_run_checkpoint, saved_run_named
from distframe.train_loop import TrainResult, initial_model_state, load_run_corpus, train_on_rank
from distframe.train_out import check_fresh_out, check_out_writable

__all__ = ["TrainConfig", "TrainResult", "run"]


def run(config: TrainConfig, start_notes: Sequence[str] = ()) -> TrainResult:
    """Trains as ``config`` says and returns rank 0's result (under a launcher, this rank's).
    With ``--resume`` and a run already at ``--steps``: a result with ``already_finished``.
    Workers that torchrun restarted continue as ``--resume`` would (``continue_after_restart``).
    ``start_notes`` (the settings' warnings) are printed by rank 0 once the run has started."""
    launcher = detect_launcher()
    if launcher is not None:
        command = LAUNCHER_COMMANDS[launcher]
        if config.optimizer == "elastic":
            raise ConfigError(f"--optimizer elastic is an in-memory demo that starts its own "
                              f"workers; run it without {command}")
        if config.backend == "inmemory":  # else each process would train alone, into one --out
            raise ConfigError(f"--backend inmemory starts its own ranks as threads of one process; under "
                              f"{command} use --backend auto (or mpi, gloo, nccl), or run it without "
                              f"{command}, with --world-size N")
        return _run_launched(config, launcher, start_notes)
    config, restart_notes = continue_after_restart(config)
    start_notes = (*start_notes, *restart_notes)
    # This one process sees OUT for every rank it starts: checked before any rank starts
    # (--steps below the checkpoint's step: ConfigError).
    if config.resume and train_checkpoint.resume_step(config.out, config.steps) == config.steps:
        return _already_finished(config, rank=0)
    given_world = config.world_size is not None
    with saved_run_named(config.resume, config.out):
        config = dataclasses.replace(config, world_size=config.world_size or DEFAULT_WORLD_SIZE)
    start_notes = (*start_notes, *world_size_note(config, given_world))
    name = "inmemory" if config.backend == "auto" else config.backend
    if config.compile is not None and name == "inmemory" and config.world_size > 1:
        raise ConfigError(f"--compile: in-memory ranks are threads of one process, which do not run "
                          f"compiled models; start the {config.world_size} ranks as processes with "
                          "--backend gloo (or mpi, nccl), or train with --world-size 1")
    check_backend_available(name, config.world_size)
    corpus = load_run_corpus(config)  # fails before any rank
    if config.resume:  # the data's vocabulary: the model's shape was checked with the settings
        check_resumed_model(config, corpus.vocab_size)
    check_windows(corpus, config.model_config(vocab_size=corpus.vocab_size).seq_len)
    check_out_writable(config.out)
    if not config.resume:  # a fresh run replaces only an earlier distframe run's files
        check_fresh_out(config.out)
    if config.optimizer == "elastic":
        from distframe.train_elastic import run_elastic
        with _threads_per_rank(config.world_size):
            return run_elastic(config, corpus, start_notes=start_notes)
    if name == "inmemory":
        fn = functools.partial(train_on_rank, config=config, backend_name=name, corpus=corpus,
                               initial_state=initial_model_state(config, corpus.vocab_size),
                               start_notes=start_notes)
        with _threads_per_rank(config.world_size):
            return spawn(fn, config.world_size, name, **timeout_of(config))[0]
    fn = functools.partial(train_on_rank, config=config, backend_name=name, start_notes=tuple(start_notes))
    return spawn(fn, config.world_size, name, **timeout_of(config))[0]


def _run_launched(config: TrainConfig, launcher: str, start_notes: Sequence[str]) -> TrainResult:
    # auto: the engine init_backend picks (under torchrun, NCCL only with a GPU per process)
    name = auto_backend_name(launcher) if config.backend == "auto" else config.backend
    with _stop_signals_end_the_process():
        backend = init_backend(name, **timeout_of(config))
    try:
        if config.world_size is not None and config.world_size != backend.world_size:
            raise ConfigError(f"--world-size {config.world_size}, but {LAUNCHER_COMMANDS[launcher]} started "
                              f"{backend.world_size} ranks; leave --world-size out when a "
                              "launcher starts the ranks")
        config, restart_notes = continue_after_restart(config, backend)
        start_notes = (*start_notes, *restart_notes)
        given_world = config.world_size is not None
        with saved_run_named(config.resume, config.out):
            config = dataclasses.replace(config, world_size=backend.world_size)
        start_notes = (*start_notes, *world_size_note(config, given_world, launcher))
        try:  # every rank writes its checkpoint shards into OUT
            check_out_writable(config.out)
            if not config.resume:
                check_fresh_out(config.out)
            error = None
        except ConfigError as exc:
            error = exc
        agree(backend, error, f"--out {config.out}")
        # Each launched process sees its own file system (node-local disks): the ranks agree
        # on the checkpoint and the verdict, or every rank raises the same ConfigError.
        if config.resume and train_checkpoint.agreed_resume_step(
                config.out, config.steps, backend) == config.steps:
            return _already_finished(config, rank=backend.rank, backend=backend)
        corpus, error = None, None
        try:  # each rank reads its own copy of --data: they agree, as on OUT
            corpus = load_run_corpus(config)
        except ConfigError as exc:
            error = exc
        agree(backend, error, "--data")
        if config.resume:  # each rank reads its own OUT/config.json: they agree on the verdict
            try:
                check_resumed_model(config, corpus.vocab_size)
                error = None
            except ConfigError as exc:
                error = exc
            agree(backend, error, "--resume")
        return train_on_rank(backend, config, backend_name=name, corpus=corpus, start_notes=start_notes)
    except BaseException as exc:
        _leave_failed(backend, exc)
        raise
    finally:
        backend.shutdown()


@contextlib.contextmanager
def _stop_signals_end_the_process() -> Iterator[None]:
    """[Note: stopping a rank that is starting] MPI_Init and torch's rendezvous wait in C, where
    the console script's Python handlers for SIGTERM and SIGHUP (and Python's for SIGINT) never
    run: such a rank could not be stopped, by one signal or by several. While the backend starts
    these signals take their default action (the process ends: there is nothing to save yet),
    and the handlers are put back once it has started."""
    if threading.current_thread() is not threading.main_thread():  # handlers are the main thread's
        yield
        return
    signums = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {signum: signal.signal(signum, signal.SIG_DFL) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: a handler that Python did not install, not restorable
                signal.signal(signum, handler)


def _leave_failed(backend: Any, exc: BaseException) -> None:
    """Departs ``backend`` as failed, so peers waiting for this rank raise RankFailedError naming
    it (``shutdown`` alone told them it had returned), and sets ``exc.rank_0_reports``: whether
    rank 0 reports this error, which the CLI then leaves to it ([Note: who reports bad input]
    in distframe.cli). A rank > 0 with bad input first waits a moment for rank 0 to depart as
    failed too (it found the same problem, as every rank usually does), before departing itself:
    rank 0 cannot then have failed because of this rank."""
    own_bad_input = backend.rank > 0 and isinstance(exc, BAD_INPUT_ERRORS)
    exc.rank_0_reports = backend.rank == 0 or (own_bad_input and _rank_0_failed(backend))
    try:
        backend.depart(failed=True)
    except Exception:  # noqa: BLE001 - the group is broken: this rank's own error is the one to raise
        pass


def _rank_0_failed(backend: Any) -> bool:
    """Whether rank 0 departs as failed within RANK_0_REPORT_WAIT seconds, as far as the engine
    sees (MPI: ranks on rank 0's node only; elsewhere the answer is no)."""
    deadline = time.monotonic() + RANK_0_REPORT_WAIT
    while True:
        try:
            departure = backend.departures().get(0)
        except Exception:  # noqa: BLE001 - the group is broken: nothing to learn from it
            return False
        if departure is not None or time.monotonic() > deadline:
            return departure is not None and departure.failed
        time.sleep(0.05)


def world_size_note(config: TrainConfig, given: bool, launcher: str | None = None) -> tuple[str, ...]:
    """A line for rank 0 when ``--resume`` continues, at ``config.world_size`` ranks that the user
    did not choose (``given`` False: the default, or what ``launcher`` started), a checkpoint
    saved at another world size. World size is a launch setting, which --resume does not take
    from the saved run; the losses of a lossy --compressor or the dropout masks then differ
    from the uninterrupted run's, which the user should hear of."""
    if not config.resume or given:
        return ()
    saved = train_checkpoint.saved_world_size(config.out)
    found = train_checkpoint.latest_checkpoint(config.out)
    if config.optimizer == "elastic" and found is not None and config.elastic_world_at(found[1]) == saved:
        return ()  # its schedule had reached the saved world, where the resumed run starts
    if saved is None or saved == config.world_size:
        return ()
    command = LAUNCHER_COMMANDS.get(launcher or "")
    ranks = f"the {_ranks(config.world_size)} {command} started" if command else \
        f"{_ranks(config.world_size)} (the default without --world-size)"
    keep = f"start {_ranks(saved)} with {command}" if command else f"pass --world-size {saved}"
    return (f"distframe train: note: the run in {config.out} was saved at world size {saved}; "
            f"--resume continues it on {ranks}; {keep} to continue at the saved world size",)


def _ranks(count: int) -> str:
    return f"{count} rank{'' if count == 1 else 's'}"


def launcher_restarts() -> int:
    """How many times the launcher has restarted this run's workers: torchrun (and torchelastic
    agents) set TORCHELASTIC_RESTART_COUNT in every worker, 0 in the first attempt's. Read here,
    where the run is launched, and nowhere deeper."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def continue_after_restart(config: TrainConfig, backend: Any = None) -> tuple[TrainConfig, tuple[str, ...]]:
    """``config`` with ``resume`` set when the launcher restarted the workers and OUT holds a
    checkpoint of this run, and the line rank 0 prints about it; ``config`` unchanged otherwise.

    [Note: a restarted run]
    torchrun --max-restarts reruns the workers' command unchanged after one dies. Without
    --resume in it, each restart replaced the run it had made, checkpoints and all, and trained
    from step 1 again; with --resume, the first attempt failed for want of a checkpoint. So a
    restarted worker continues from the latest checkpoint as --resume would (torchtitan loads
    its latest checkpoint on every start), or starts afresh if there is none yet. OUT holding a
    run of other settings (the first attempt died before replacing it) is a ConfigError: a
    restart never deletes checkpoints. Launched ranks (``backend``) may see different disks: if
    any rank sees the run's checkpoint, all continue, and --resume's own agreement on the step
    (``agreed_resume_step``) stops them all if their disks differ."""
    restarts = launcher_restarts()
    if config.resume or restarts < 1:
        return config, ()
    found, error = None, None
    try:
        found = restarted_run_checkpoint(config)
    except ConfigError as exc:
        error = exc
    if backend is None:
        if error is not None:
            raise error
        resume = found is not None
    else:
        agree(backend, error, f"--out {config.out}")
        seen = backend.all_gather(torch.tensor([found is not None], dtype=torch.int64))
        resume = bool(seen.max())
    said = f"distframe train: the launcher restarted the workers (TORCHELASTIC_RESTART_COUNT={restarts}): "
    if found is not None:
        note = f"{said}continuing from {found[0]}, as --resume would"
    elif resume:
        note = f"{said}continuing from the latest checkpoint in {config.out}, as --resume would"
    else:
        note = f"{said}no checkpoint of this run in {config.out} yet, so it starts again from step 1"
    return dataclasses.replace(config, resume=resume), (note,)


def _already_finished(config: TrainConfig, rank: int, backend: Any = None) -> TrainResult:
    """The result of ``--resume`` on a run that reached ``--steps``: nothing to train, if its last
    checkpoint is intact (all of its files are read; every rank of ``backend`` checks its own
    copy and they agree): else the run is not finished, and the error says how to redo the
    steps after the latest intact checkpoint."""
    found = train_checkpoint.latest_checkpoint(config.out)
    error = None
    try:
        if found is not None:
            train_checkpoint.check_intact(found[0])
    except CheckpointError as exc:
        error = exc
    if backend is not None:
        agree(backend, error, "--resume")
    elif error is not None:
        raise error
    return TrainResult(step=config.steps, train_loss=None, val_loss=None, tokens_per_s=0.0,
                       peak_memory_bytes=0, wall_s=0.0, out=config.out,
                       checkpoint=found[0] if found else None, rank=rank, already_finished=True)


def check_backend_available(name: str, world_size: int) -> None:
    """BackendUnavailableError, naming what to install or choose, if ``name`` cannot run here."""
    if name == "mpi":
        from distframe._mpi_launch import find_mpiexec
        find_mpiexec()
    elif name == "nccl":
        from distframe.backends.torch_dist import visible_gpus
        gpus = visible_gpus()
        if gpus < world_size:
            raise BackendUnavailableError(
                f"--backend nccl needs a CUDA GPU per rank ({world_size} ranks, {gpus} GPUs "
                "found); use --backend gloo or inmemory on CPU, or a smaller --world-size")
    elif name == "gloo" and not torch.distributed.is_available():
        raise BackendUnavailableError("--backend gloo needs a torch build with torch.distributed; "
                                      "use --backend inmemory or mpi")


_threads_lock = threading.Lock()
_runs = 0  # runs of this process inside _threads_per_rank
_threads_before = 1  # torch's thread count before the first of them


@contextlib.contextmanager
def _threads_per_rank(world_size: int) -> Iterator[None]:
    """In-memory ranks are threads of one process: share the cores among them instead of
    letting every rank's kernels start a full set of threads (as torchrun's OMP_NUM_THREADS).
    The cores are those this process may use (its CPU affinity, as ``taskset`` or a container
    sets it) and no more than torch's own thread count (``OMP_NUM_THREADS`` when the user set it):
    ``os.cpu_count()`` alone gave one rank the machine's every core against the user's setting."""
    global _runs, _threads_before
    with _threads_lock:  # runs on threads of one process: the first sets, the last restores
        if _runs == 0:
            _threads_before = torch.get_num_threads()
        _runs += 1
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, min(cores, _threads_before) // world_size))
    try:
        yield
    finally:
        with _threads_lock:
            _runs -= 1
            if _runs == 0:
                torch.set_num_threads(_threads_before)
