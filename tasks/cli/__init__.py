"""The ``sessionstore`` command line. Thin: every command calls into ``core`` (or the queue).

REGISTRATION RULE (keep start-up fast): a command module is imported only when one of its
commands runs, or when its own ``--help`` is asked for. To add commands:
  1. write ``tasks/cli/<module>.py`` defining ``cli = new_app()`` and its commands on it
     (groups via ``cli.add_typer(group, name=...)``);
  2. add one line per top-level name to ``COMMANDS`` below (module, one-line help).
In the module, import only typer and ``tasks.cli.common`` at module level; import celery,
sqlalchemy, ``core.store``, ``tasks.app``, rich tables... inside the command bodies.
``tests/test_cli_startup.py`` fails when a ``--help`` imports one of them.
"""

from __future__ import annotations

import importlib
import io
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from typer import _click
from typer.core import TyperGroup

# name -> (module, one-line help shown by `sessionstore --help` without importing it)
COMMANDS: dict[str, tuple[str, str]] = {
    "append": ("tasks.cli.writes", "Append events from a JSONL file or stdin."),
    "beat": ("tasks.cli.runtime", "Run Celery beat: blob GC, expiry, fork-copy reconciler."),
    "blobs": ("tasks.cli.blobs", "The blob store: verify every blob, quarantine, repair."),
    "db": ("tasks.cli.db", "Schema management (Alembic): upgrade, check, history..."),
    "dead-letters": ("tasks.cli.writes", "Rejected queued writes: list, show, replay..."),
    "demo": ("tasks.cli.demo", "Run the whole system in a fresh temporary data dir."),
    "events": ("tasks.cli.query", "List events by global position, or follow new ones."),
    "expire": ("tasks.cli.maintenance", "Remove oversized-output artifacts past their TTL."),
    "export": ("tasks.cli.interop", "Write a session as a pi session file (or via a worker)."),
    "gc": ("tasks.cli.maintenance", "Collect unreferenced blobs and stray blob files."),
    "health": ("tasks.cli.health", "Check the database, broker, blob and artifact storage."),
    "import": ("tasks.cli.interop", "Import pi / oh-my-pi / Claude Code session files."),
    "maintenance-runs": ("tasks.cli.maintenance", "The latest periodic maintenance runs."),
    "queue": ("tasks.cli.queue", "The queue: depth, unacked, dead letters, workers."),
    "read": ("tasks.cli.read", "Print what a URL (artifact://, agent://, blob:...) resolves to."),
    "sessions": ("tasks.cli.sessions", "Sessions: list, show, fork, move, delete..."),
    "settings": ("tasks.cli.config", "Show the effective settings, or the README table."),
    "state": ("tasks.cli.query", "A session's state rebuilt from its journal."),
    "stats": ("tasks.cli.query", "Events, sessions, tokens, blob dedup, artifacts."),
    "worker": ("tasks.cli.runtime", "Run a Celery worker for the sessionstore queue."),
}


class OutputClosed(Exception):
    """A write to stdout or stderr met a pipe whose reader is gone (``| head``). Carried past
    typer as this, not as the ``BrokenPipeError``: typer ends a run with exit 1 on any EPIPE
    (a socket's too), where ``main`` tells a closed output (exit 141) from another error."""


@contextmanager
def _output_guard() -> Iterator[None]:
    try:
        yield
    except BrokenPipeError as exc:
        raise OutputClosed() from exc


class LazyGroup(TyperGroup):
    """The top-level group: commands come from ``COMMANDS``, imported on demand."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: _click.Context | None = None,
        **extra: Any,
    ) -> _click.Context:
        with _output_guard():  # an eager option's output: --help
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: _click.Context) -> Any:
        with _output_guard():  # every command runs in here
            return super().invoke(ctx)

    def list_commands(self, ctx: _click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: _click.Context, cmd_name: str) -> _click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module = importlib.import_module(COMMANDS[cmd_name][0])
        cli: typer.Typer = module.cli
        # Convert only the command asked for: typer builds a pydantic adapter per parameter,
        # so converting a module's every command would cost start-up time for nothing.
        for info in cli.registered_commands:
            assert info.callback is not None
            if (info.name or typer.main.get_command_name(info.callback.__name__)) == cmd_name:
                return typer.main.get_command_from_info(
                    info, pretty_exceptions_short=False, rich_markup_mode=None
                )
        for group in cli.registered_groups:
            if group.name == cmd_name:
                return typer.main.get_group_from_info(
                    group,
                    pretty_exceptions_short=False,
                    suggest_commands=True,
                    rich_markup_mode=None,
                )
        raise LookupError(f"{COMMANDS[cmd_name][0]} defines no command {cmd_name!r}")

    def format_commands(self, ctx: _click.Context, formatter: _click.HelpFormatter) -> None:
        # The short help comes from COMMANDS: listing commands imports none of them.
        with formatter.section("Commands"):
            formatter.write_dl([(name, COMMANDS[name][1]) for name in sorted(COMMANDS)])


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"sessionstore {version('sessionstore')}"
    except PackageNotFoundError:  # a source tree that was not installed
        return "sessionstore (not installed)"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(_version())
        raise typer.Exit()


app = typer.Typer(
    cls=LazyGroup,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,
    help="Event-sourced storage for AI coding-agent sessions.\n\n"
    "Expected failures print one line and exit with a documented code (README: Exit codes).",
)


@app.callback()
def _options(
    version: bool = typer.Option(
        False,
        "--version",
        is_eager=True,
        callback=_show_version,
        help="Print the version and exit.",
    ),
    debug: bool = typer.Option(
        False, "--debug", help="Show the traceback of a failure (also SESSIONSTORE_DEBUG=1)."
    ),
) -> None:
    """Global options (read by ``main`` before the command runs)."""


def main(argv: list[str] | None = None) -> None:
    """Entry point: expected failures become one line on stderr and a documented exit code
    (``tasks.cli.failures.ExitCode``); ``--debug`` or SESSIONSTORE_DEBUG=1 adds the traceback.
    A usage error is one line too, and a reader gone from the pipe a silent exit 141.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if sys.stdout is None:  # started with no descriptor 1 (``>&-``)
        _closed_stdout(args)
    _whole_writes()
    try:
        if args == ["--version"]:  # the fastest path: no typer at all would not be faster
            print(_version())
        else:
            _run(args)
        # now, not at the interpreter's exit: a closed pipe is then this run's to report
        sys.stdout.flush()
    except (BrokenPipeError, OutputClosed) as exc:
        _closed_pipe(exc.__cause__ or exc, args)


# what runs with its output closed: a daemon, whose output is its log (Celery redirects it)
_DAEMONS = frozenset({"worker", "beat"})


def _closed_stdout(args: list[str]) -> None:
    """Descriptor 1 is given /dev/null: the next file opened would get it, and a stray
    write land in that file. A daemon runs on; any other command, whose output is what it is
    run for, stops with one line and exit 3 (an output that cannot be written)."""
    _to_devnull([1])
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    command = next((a for a in args if not a.startswith("-")), None)
    if command not in _DAEMONS:
        sys.stderr.write("error: standard output is closed (redirect it: `> FILE`, `| ...`)\n")
        sys.exit(3)  # ExitCode.BAD_INPUT


class _WholeWrites(io.RawIOBase):
    """Descriptor 1, each write written whole or failed. A write to a pipe whose reader
    leaves part way through returns the part written; unbuffered (PYTHONUNBUFFERED, which
    the compose image sets), ``sys.stdout`` writes straight to its file and drops the rest
    in silence (a 1 MB document cut at 64 KB, exit 0 under ``| head -c 10``). Here the next
    write meets the EPIPE: the reader gone, exit 141."""

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return 1

    def isatty(self) -> bool:
        return os.isatty(1)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.write(1, view[done:])
        return done


def _whole_writes() -> None:
    """An unbuffered ``sys.stdout`` on ``_WholeWrites``, its encoding as it was (a buffered
    one writes the rest of a short write itself); left alone when it is not the process's
    own descriptor 1 (a test's capture)."""
    out = sys.stdout
    if type(out) is not io.TextIOWrapper or type(out.buffer) is not io.FileIO:
        return
    if out.buffer.fileno() != 1:
        return
    out.flush()
    sys.stdout = io.TextIOWrapper(
        _WholeWrites(),
        encoding=out.encoding,
        errors=out.errors,
        line_buffering=out.line_buffering,
        write_through=True,
    )


def _log_to_stderr(args: list[str]) -> None:
    """Warnings and errors logged while a command runs go to stderr as ``LEVEL: message``
    (Python's last-resort handler printed the bare message, which read as the command's
    output; a defect's traceback follows it). Not for a daemon (``worker``, ``beat``):
    Celery sets up its own log, and this would double each line. Nor for help, which
    logs nothing: ``logging`` stays unloaded there (start-up time)."""
    command = next((a for a in args if not a.startswith("-")), None)
    if command is None or command in _DAEMONS or "--help" in args or "-h" in args:
        return
    import logging

    class StderrLog(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            try:  # sys.stderr looked up at each record: a test swaps it
                sys.stderr.write(self.format(record) + "\n")
                sys.stderr.flush()
            except OSError:  # stderr closed, or a pipe nobody reads: the line is dropped,
                pass  # and the command goes on (as with Python's last-resort handler)
            except Exception:
                self.handleError(record)

    class CliFormat(logging.Formatter):
        def formatMessage(self, record: logging.LogRecord) -> str:
            return f"{record.levelname.lower()}: {record.message}"

    handler = StderrLog(logging.WARNING)
    handler.setFormatter(CliFormat())
    logging.getLogger().addHandler(handler)


def _run(args: list[str]) -> None:
    from tasks.cli.failures import debug_enabled, fail, usage_failed

    debug = debug_enabled(args)
    _log_to_stderr(args)
    try:
        # not standalone: a usage error reaches usage_failed (one line), where click
        # printed its usage block
        code = app(args=args, prog_name="sessionstore", standalone_mode=False)
    except OutputClosed:
        raise
    except _click.exceptions.ClickException as exc:
        usage_failed(exc)
    except typer.Abort:  # a question answered no
        sys.stderr.write("Aborted!\n")
        sys.exit(1)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        fail(exc, debug=debug)
    else:
        # typer.Exit(code) comes back as its code; a command's own return value is None
        if isinstance(code, int) and code:
            sys.exit(code)


# 128 + SIGPIPE: how a shell reports a tool the signal ended (``yes | head -1``)
EXIT_PIPE_CLOSED = 141


def _closed_pipe(exc: BaseException, args: list[str]) -> None:
    """Exit 141 in silence when stdout or stderr is a pipe its reader closed; any other
    broken pipe (a socket) is a failure like any other. The closed descriptors are pointed
    at /dev/null, so that flushing them at exit does not fail again (Python docs: "Note on
    SIGPIPE")."""
    closed = [fd for fd in (1, 2) if _reader_gone(fd)]
    if not closed:
        from tasks.cli.failures import debug_enabled, fail

        fail(exc, debug=debug_enabled(args))
    _to_devnull(closed)
    sys.exit(EXIT_PIPE_CLOSED)


def _to_devnull(fds: list[int]) -> None:
    """Point ``fds`` at /dev/null, open or closed (a closed one may be what opening it
    takes)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in fds:
        if fd != devnull:
            os.dup2(devnull, fd)
    if devnull not in fds:
        os.close(devnull)


def _reader_gone(fd: int) -> bool:
    """Whether ``fd`` is a pipe (or socket) with nobody left to read it: poll says POLLERR
    for a pipe whose read end is closed (POLLHUP for a socket shut down)."""
    import select

    try:
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        ready = poller.poll(0)
    except (OSError, ValueError, AttributeError):  # no such descriptor, or no poll()
        return False
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in ready)
