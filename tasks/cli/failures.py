"""Expected failures -> one line on stderr and a documented exit code (README: "Exit codes").

Imports nothing heavy at module level: the start-up path imports this module.
"""

from __future__ import annotations

import os
import sys
import traceback
from enum import IntEnum

from core import errors


class ExitCode(IntEnum):
    """The exit codes of ``sessionstore`` (the README's table is built from this)."""

    OK = 0
    FAILED = 1  # the operation ran and reported a failure (e.g. GC errors, a rejected write)
    USAGE = 2  # a bad option or argument (click's own code)
    BAD_INPUT = 3  # invalid events, a file that cannot be read or written, a bad value
    NOT_FOUND = 4  # a bad id: no such session, dead letter, artifact or blob
    BAD_CONFIG = 5  # a bad URL or setting in SESSIONSTORE_* variables
    STORAGE_UNAVAILABLE = 6  # a store unreachable or full, or a session's move pending
    DATABASE_UNAVAILABLE = 6  # the name of code 6 before blobs and artifacts shared it
    BROKER_UNAVAILABLE = 7  # the Celery broker cannot be reached
    SCHEMA_NOT_CURRENT = 8  # the schema is missing, behind (`db upgrade`) or ahead of the code
    DATABASE_MISSING = 9  # no embedded database at the path (read-only commands never create one)


# By the unavailable component (``StorageUnavailable.component``): what it is, what to check.
_COMPONENTS = {
    "database": ("database", "check SESSIONSTORE_DATABASE_URL and that the database runs"),
    "broker": ("broker", "check SESSIONSTORE_BROKER_URL and that the broker runs"),
    "blobs": (
        "blob store",
        "check SESSIONSTORE_BLOB_URL and its disk's free space; for s3:// also "
        "AWS_ENDPOINT_URL, the AWS_* credentials and that the endpoint runs",
    ),
    "artifacts": (
        "artifact store",
        "check SESSIONSTORE_ARTIFACT_URL and its disk's free space; for s3:// also "
        "AWS_ENDPOINT_URL, the AWS_* credentials and that the endpoint runs",
    ),
}
_HINTS = {
    ExitCode.SCHEMA_NOT_CURRENT: "run `sessionstore db upgrade`",
    ExitCode.DATABASE_MISSING: "check SESSIONSTORE_DATA_DIR and SESSIONSTORE_DATABASE_URL, "
    "or create it with `sessionstore db upgrade`",
}

# Driver errors that mean "a backend cannot be reached", by class name so the CLI imports
# no driver. This is the ONE place the CLI maps driver errors; it shrinks to nothing once
# core raises StorageUnavailable for all of them (the driver-error translation layer).
_DRIVER_ERRORS = {
    "sqlalchemy.exc.OperationalError": "database",
    "sqlalchemy.exc.InterfaceError": "database",
    "sqlalchemy.exc.TimeoutError": "database",
    "psycopg.OperationalError": "database",
    "kombu.exceptions.OperationalError": "broker",
    "redis.exceptions.ConnectionError": "broker",
    "redis.exceptions.TimeoutError": "broker",
}


def _driver_component(exc: BaseException) -> str | None:
    for cls in type(exc).__mro__:
        component = _DRIVER_ERRORS.get(f"{cls.__module__}.{cls.__qualname__}")
        if component:
            return component
    return None


def classify(exc: BaseException) -> tuple[ExitCode, str] | None:
    """(exit code, one-line message) for an expected failure; None for a bug."""
    if isinstance(exc, errors.ImportInterrupted):  # exits as what interrupted it, says it so
        cause = classify(exc.cause)
        if cause is None:
            return ExitCode.FAILED, exc.message
        said = exc.cause.message if isinstance(exc.cause, errors.SessionStoreError) else ""
        return cause[0], exc.message.replace(said, cause[1], 1) if said else exc.message
    if isinstance(exc, errors.SessionMoving):  # transient, but no store to check: its message
        return ExitCode.STORAGE_UNAVAILABLE, exc.message
    if isinstance(exc, errors.StorageUnavailable):
        detail = exc.message.removeprefix(f"{exc.component} is unavailable: ")
        return _unavailable(exc.component, detail)
    component = _driver_component(exc)
    if component is not None:
        return _unavailable(component, (str(exc).strip().splitlines() or [type(exc).__name__])[0])
    if isinstance(exc, errors.SchemaNotCurrent):
        return ExitCode.SCHEMA_NOT_CURRENT, exc.message
    if isinstance(exc, errors.DatabaseMissing):
        return ExitCode.DATABASE_MISSING, exc.message
    if isinstance(
        exc,
        (
            errors.SessionNotFound,
            errors.DeadLetterNotFound,
            errors.ArtifactNotFound,
            errors.BlobNotFound,
            errors.ResolveNotFound,
        ),
    ):
        return ExitCode.NOT_FOUND, exc.message
    if isinstance(exc, errors.BadConfig):
        return ExitCode.BAD_CONFIG, exc.message
    bad_input = (errors.InvalidEvent, errors.InvalidBlobHash, errors.InvalidForkPoint)
    unusable_file = (errors.UnreadableFile, errors.UnwritableFile)
    if isinstance(exc, (*bad_input, errors.ResolveError, *unusable_file)):
        return ExitCode.BAD_INPUT, exc.message
    if isinstance(exc, errors.SessionStoreError):
        return ExitCode.FAILED, exc.message
    if isinstance(exc, OSError):
        return ExitCode.BAD_INPUT, os_error_text(exc)
    if isinstance(exc, ValueError):
        return ExitCode.BAD_INPUT, str(exc)
    return None


def os_error_text(exc: OSError) -> str:
    """An ``OSError`` as a person reads it: the path, then why ("x.jsonl: No such file or
    directory"), not Python's "[Errno 2] No such file or directory: 'x.jsonl'"."""
    reason = exc.strerror or str(exc)
    names = [_name(n) for n in (exc.filename, exc.filename2) if n is not None]
    return f"{' -> '.join(names)}: {reason}" if names else reason


def _name(filename: object) -> str:
    """A path as text (bytes decoded as the file system's); a descriptor as ``fd N``."""
    if isinstance(filename, (str, bytes, os.PathLike)):
        return os.fsdecode(filename)
    return f"fd {filename}" if isinstance(filename, int) else str(filename)


# What no file of a run can get past: an import stops at the first (README: Exit codes).
ENVIRONMENT = frozenset(
    {
        ExitCode.BAD_CONFIG,
        ExitCode.STORAGE_UNAVAILABLE,
        ExitCode.BROKER_UNAVAILABLE,
        ExitCode.SCHEMA_NOT_CURRENT,
        ExitCode.DATABASE_MISSING,
    }
)


def _unavailable(component: str, detail: str) -> tuple[ExitCode, str]:
    """A storage backend is unreachable (or full): which one, why, and what to check."""
    code = ExitCode.BROKER_UNAVAILABLE if component == "broker" else ExitCode.STORAGE_UNAVAILABLE
    name, hint = _COMPONENTS.get(component, (component, ""))
    return code, f"{name} unavailable: {detail}" + (f" ({hint})" if hint else "")


def _hint(exc: BaseException, code: ExitCode) -> str | None:
    """What to do, added to the line of a failure with ``code``: none for a schema a newer
    release wrote, whose message says what to do (upgrading is what cannot help)."""
    if isinstance(exc, errors.ImportInterrupted):
        return _hint(exc.cause, code)
    if isinstance(exc, errors.SchemaAhead):
        return None
    return _HINTS.get(code)


def debug_enabled(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("SESSIONSTORE_DEBUG", "") not in ("", "0")


def fail(exc: BaseException, *, debug: bool) -> None:
    """Report ``exc`` and exit: one line (or the traceback with ``debug``)."""
    classified = classify(exc)
    if classified is None:  # a bug: always the traceback
        raise exc
    code, message = classified
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    hint = _hint(exc, code)
    from tasks.cli.common import literal

    # one line, and a path's control character or byte that is not UTF-8 as its escape
    line = literal(" ".join(message.split())) or type(exc).__name__
    if hint and hint not in line:
        line = f"{line} ({hint})"
    sys.stderr.write(f"error: {line}\n")
    sys.stderr.flush()
    sys.exit(int(code))


def usage_failed(exc: BaseException) -> None:
    """Report a click error and exit with its code (2 for usage): one line, as every other
    failure, with where the command's help is (click printed a usage block of four lines).
    ``sessionstore`` or a group alone still shows its help."""
    from typer import _click

    if isinstance(exc, _click.exceptions.NoArgsIsHelpError):
        exc.show()
        sys.exit(exc.exit_code)
    assert isinstance(exc, _click.exceptions.ClickException)
    from tasks.cli.common import literal

    line = literal(" ".join(exc.format_message().split()))
    ctx = getattr(exc, "ctx", None)
    if ctx is not None and ctx.command.get_help_option(ctx) is not None:
        line = f"{line} (see `{ctx.command_path} {ctx.help_option_names[0]}`)"
    sys.stderr.write(f"error: {line}\n")
    sys.stderr.flush()
    sys.exit(exc.exit_code)
