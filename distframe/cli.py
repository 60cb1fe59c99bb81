"""The ``distframe`` command: ``distframe train`` and ``distframe generate``.

Exit status: 0 done (also when the reader of stdout has gone, as after ``| head``: quietly); 2 bad
input (a ConfigError, an engine that cannot run here, a bad flag, a file that is missing or cannot
be read), reported as one line that says what to change; 1 another distframe error or an I/O
error (one line); 130 interrupted (Ctrl-C, or SIGTERM/SIGHUP to the console script: the last
complete checkpoint stays loadable). ``--debug`` shows tracebacks.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import BinaryIO

from distframe.errors import BackendUnavailableError, ConfigError, DistFrameError

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


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
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = _parse(build_parser(), argv)
    except SystemExit as exc:  # --help (0) or a bad flag (2, already reported in one line)
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    status = 0
    try:
        status = args.handler(args)
        write_stdout("")  # flushed here: a reader gone shows now, not as the interpreter exits
        return status
    except StdoutClosed:
        return _stdout_closed(status)
    except KeyboardInterrupt:
        print("\ndistframe: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ConfigError, BackendUnavailableError, FileNotFoundError, PermissionError, IsADirectoryError,
            NotADirectoryError) as exc:
        # Bad input is found the same way on every rank a launcher started: rank 0 reports it.
        return _report(exc, debug, EXIT_BAD_INPUT, quiet=_launched_rank() > 0)
    except (DistFrameError, OSError) as exc:  # OSError: a full disk, an I/O error
        return _report(exc, debug, 1)


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
    an interrupted process flushes its streams and leaves with ``os._exit`` instead.
    """
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    status = main()
    if status == EXIT_INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


def _interrupt(signum: int, frame: object) -> None:  # noqa: ARG001 - a signal handler's signature
    """SIGTERM (a scheduler's or launcher's stop, ``kill``) and SIGHUP (the terminal closed) take
    Ctrl-C's path: KeyboardInterrupt, so a launcher tears its rank processes down (which a
    terminated parent would leave running) and the run reports its last complete checkpoint.
    A second signal of either kind kills the process at once (the default action), as a stop
    that the teardown does not finish must still end it."""
    for other in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(other, signal.SIG_DFL)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")
