"""The ``distframe`` command: ``distframe train`` and ``distframe generate``.

Exit status: 0 done (also when the reader of stdout has gone, as after ``| head``: quietly); 2 bad
input (a ConfigError, an engine that cannot run here, a bad flag, a file that is missing or cannot
be read), reported as one line that says what to change; 1 another distframe error or an I/O
error (one line); 130 interrupted (Ctrl-C, or SIGTERM/SIGHUP to the console script: the last
complete checkpoint stays loadable). ``--debug`` shows tracebacks. Under mpiexec or torchrun,
see [Note: who reports bad input].
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import BinaryIO

from distframe.errors import BackendUnavailableError, ConfigError, DistFrameError

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
BAD_INPUT_ERRORS = (ConfigError, BackendUnavailableError, FileNotFoundError, PermissionError,
                    IsADirectoryError, NotADirectoryError)
RANK_0_REPORT_WAIT = 2.0  # seconds a launched rank > 0 gives rank 0 to report bad input they share
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (exit status 2) instead of the usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from distframe.train_cli import add_generate_arguments, add_train_arguments
    from distframe import __version__
    parser = _Parser(prog="distframe", description="Distributed training with distframe.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True
    train = commands.add_parser(
        "train", help="train the dilated-attention language model",
        description="Train DilatedTransformerLM with a data- or model-parallel strategy. With no flags: "
                    "the small preset on 2 in-memory ranks over the Python standard library's "
                    "sources, a few minutes on a laptop CPU. Outputs go to --out: metrics.jsonl "
                    "(peak_memory_bytes is the process's peak resident memory on CPU, shared by "
                    "in-memory ranks, and torch.cuda.max_memory_allocated on a GPU), config.json, "
                    "checkpoints/step-N and loss.png (with matplotlib).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_train_arguments(train)
    generate = commands.add_parser(
        "generate", help="sample text from a trained checkpoint",
        description="Sample text from a checkpoint that distframe train wrote.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_generate_arguments(generate)
    parser.commands = {"train": train, "generate": generate}  # (for _parse's errors)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command in ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    return _run_command(argv)[0]


def _run_command(argv: Sequence[str] | None) -> tuple[int, BaseException | None]:
    """``main``'s exit status, and the error that ended the command (None: none, or a bad flag)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = _parse(build_parser(), argv)
    except SystemExit as exc:  # --help (0) or a bad flag (2, already reported in one line)
        return (exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT), None
    status = 0
    try:
        status = args.handler(args)
        write_stdout("")  # flushed here: a reader gone shows now, not as the interpreter exits
        return status, None
    except StdoutClosed:
        return _stdout_closed(status), None
    except KeyboardInterrupt as exc:
        print("\ndistframe: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED, exc
    except BAD_INPUT_ERRORS as exc:
        return _report(exc, debug, EXIT_BAD_INPUT, quiet=_left_to_rank_0(exc)), exc
    except (DistFrameError, OSError) as exc:  # OSError: a full disk, an I/O error
        return _report(exc, debug, 1), exc


def _left_to_rank_0(exc: BaseException) -> bool:
    """Whether this rank leaves the report of bad input ``exc`` to rank 0.

    [Note: who reports bad input]
    Under a launcher, bad input is most often the same on every rank (the same flags; files on a
    shared file system): rank 0 reports it and the others stay quiet, as N copies of one line
    say nothing more. But it can be one rank's own (a node whose disk lacks --data), and a rank
    that stayed quiet took the reason with it. So a rank > 0 reports its bad input, naming its
    rank, unless rank 0 has failed too:
    * found once the backend has started: ``train._leave_failed`` waits a moment for rank 0 to
      depart as failed (``exc.rank_0_reports``), then departs as failed itself, so that its peers
      raise RankFailedError naming it (problems read from node-local files, OUT and --data, are
      agreed on by the ranks instead: rank 0 reports them for every rank);
    * found before (or while) the backend starts, there is no one to ask: ``main`` stays quiet,
      and the console script (``_end_launched_job``) gives rank 0 a moment to end the job (which
      mpiexec does at rank 0's MPI_Abort, torchrun once a worker has failed), then reports. A rank
      under mpiexec that leaves before its backend has started aborts the job: its peers would
      wait for it in MPI_Init, which has no timeout, for ever.
    Without a launcher (and with only some of torchrun's variables, a ConfigError) every process
    reports its own errors."""
    if _launched_rank() == 0 or _launcher() is None:
        return False
    return getattr(exc, "rank_0_reports", True)


def _launcher() -> str | None:
    """``detect_launcher()``, or None where its variables are themselves the error."""
    from distframe.launch import detect_launcher
    try:
        return detect_launcher()
    except ConfigError:
        return None


class StdoutClosed(Exception):
    """The reader of stdout has gone (``distframe generate | head -c 20``)."""


def write_stdout(data: str | bytes) -> None:
    """``data`` to stdout, flushed; StdoutClosed where the reader has gone (a BrokenPipeError
    elsewhere, a socket between ranks, stays an error). Bytes go to a stdout that is a file (a
    terminal, a pipe, a file) as they are, after any text printed before; a stream in memory in
    its place (an io.StringIO, a test's capture, which reads back strict UTF-8) takes them as
    text, invalid bytes replaced."""
    try:
        buffer = _file_buffer(sys.stdout)
        if isinstance(data, bytes) and buffer is not None:
            sys.stdout.flush()
            buffer.write(data)
            buffer.flush()
        else:
            sys.stdout.write(data if isinstance(data, str) else data.decode("utf-8", errors="replace"))
            sys.stdout.flush()
    except BrokenPipeError:
        raise StdoutClosed from None


def _file_buffer(stream: object) -> BinaryIO | None:
    """``stream``'s byte stream where it writes to a file descriptor, else None."""
    try:
        stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last
        return None
    return getattr(stream, "buffer", None)


def _stdout_closed(status: int) -> int:
    """The command's ``status`` (0 where it had not returned), quietly, as ``head``-style
    pipelines expect: the reader took what it wanted and the command's work is done (141,
    128 + SIGPIPE, would fail a ``set -o pipefail`` script that cut the output short on purpose).
    Stdout then goes to os.devnull, so that the interpreter's own flush at exit does not fail on
    the pipe again ("Exception ignored ... BrokenPipeError", status 120)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (AttributeError, OSError, ValueError):  # a stdout without a file descriptor
        pass
    return status


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with arguments that no parser took reported by the command's
    own parser: argparse reports them from the top one, whose line said "see distframe --help",
    where the flags are those of ``distframe train --help``."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        commands = getattr(parser, "commands", {})
        command = commands.get(getattr(args, "command", None), parser)
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _report(exc: BaseException, debug: bool, status: int, quiet: bool = False) -> int:
    if quiet and not debug:
        return status
    if debug:
        traceback.print_exception(exc)
    message = _one_line(str(exc)) or type(exc).__name__
    hint = " (--debug shows the traceback)" if status == 1 and not debug else ""
    rank = _launched_rank()
    where = f" [rank {rank}]" if rank > 0 else ""
    print(f"distframe: error{where}: {message}{hint}", file=sys.stderr)
    return status


def _one_line(text: str) -> str:
    """A message's lines joined (a failure on several ranks gives each reason a line of its own)."""
    joined = ""
    for line in filter(None, (line.strip() for line in text.splitlines())):
        joined += line if not joined else (" " if joined.endswith(":") else "; ") + line
    return joined


def _launched_rank() -> int:
    """This process's rank when mpiexec/mpirun or torchrun started it, else 0."""
    for name in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


def entry_point() -> None:
    """The ``distframe`` console script and ``python -m distframe``: ``main()``, then exit.

    [Note: exiting after Ctrl-C] After an interrupt the run has already reported where its last
    complete checkpoint is, and every checkpoint on disk is complete (saves are renamed into
    place). Interpreter teardown can then abort in torch's C++ static destructors (about one
    interrupted run in six here: "terminate called without an active exception", status -6), so
    an interrupted process flushes its streams and leaves with ``os._exit`` instead; under
    mpiexec it first unlinks MPICH's shared-memory segments, which only ``MPI_Finalize`` would
    have (each interrupted run left about 2 MB in /dev/shm for good).
    """
    _handle_stop_signals()
    status, error = _run_command(None)
    if status not in (0, EXIT_INTERRUPTED) and not hasattr(error, "rank_0_reports"):
        _end_launched_job(status, error)  # it ended before a launched backend had started
    if status == EXIT_INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        if _launcher() == "mpi":  # MPICH unlinks its shared memory in MPI_Finalize, skipped here
            from distframe._mpi_segments import unlink_own_segments
            unlink_own_segments()
        os._exit(status)
    sys.exit(status)


def _end_launched_job(status: int, error: BaseException | None) -> None:
    """For a process that a launcher started and that leaves with ``status`` before its backend
    has started: reports bad input that ``main`` left to rank 0, if rank 0 has not ended the job
    meanwhile, and under mpiexec aborts the job ([Note: who reports bad input])."""
    launcher = _launcher()
    if launcher is None:
        return
    for signum in STOP_SIGNALS:  # from here a stop ends the process at once, in MPI_Init too
        signal.signal(signum, signal.SIG_DFL)
    world = None
    if launcher == "mpi":
        from distframe.launch import start_mpi
        world = start_mpi()  # completes the peers' MPI_Init, so that an abort reaches them
    if isinstance(error, BAD_INPUT_ERRORS) and _left_to_rank_0(error):
        time.sleep(RANK_0_REPORT_WAIT)  # rank 0 ends the job (this process too) if it failed alike
        _report(error, "--debug" in sys.argv, status)
    sys.stdout.flush()
    sys.stderr.flush()
    if world is not None:
        world.Abort(status)


def _handle_stop_signals() -> None:
    """SIGTERM and SIGHUP raise KeyboardInterrupt (``_interrupt``); a second one kills the process
    at once, also while the first waits for its handler (``_kill_on_second_stop``)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _interrupt)
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    threading.Thread(target=_kill_on_second_stop, args=(reader, writer), name="distframe-stop-signals",
                     daemon=True).start()


def _interrupt(signum: int, frame: object) -> None:  # noqa: ARG001 - a signal handler's signature
    """SIGTERM (a scheduler's or launcher's stop, ``kill``) and SIGHUP (the terminal closed) take
    Ctrl-C's path: KeyboardInterrupt, so a launcher tears its rank processes down (which a
    terminated parent would leave running) and the run reports its last complete checkpoint.
    A second signal of either kind kills the process at once (the default action), as a stop
    that the teardown does not finish must still end it."""
    for other in STOP_SIGNALS:
        signal.signal(other, signal.SIG_DFL)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def _kill_on_second_stop(reader: socket.socket, writer: socket.socket) -> None:  # noqa: ARG001
    """[Note: a second stop signal] Python runs a signal's handler in the main thread, between
    bytecodes: while that thread waits in C (MPI_Init, a rendezvous, a collective without a
    timeout) ``_interrupt`` cannot run, nor give the signals their default action back, and
    every further signal waited behind the first: the process could not be stopped. The C-level
    handler writes each signal's number to the wakeup fd (``writer``) at once; this thread reads
    them, and on a second stop signal kills the process (SIGKILL: only the main thread may
    reset a handler). Once ``_interrupt`` has run, stop signals no longer come here."""
    stops = 0
    while data := reader.recv(64):
        stops += sum(signum in STOP_SIGNALS for signum in data)
        if stops >= 2:
            os.kill(os.getpid(), signal.SIGKILL)
