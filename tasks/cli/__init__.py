"""The ``sessionstore`` command line. Thin: every command calls into ``core`` (or the queue)."""

from __future__ import annotations

import sys

from core.errors import SessionStoreError
from tasks.cli.common import app, err_console


def _register() -> None:
    # Each module adds its commands to ``app`` when imported.
    from tasks.cli import (  # noqa: F401
        config,
        db,
        demo,
        health,
        maintenance,
        query,
        read,
        runtime,
        sessions,
        writes,
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and a non-zero exit, no traceback.

    Typer runs standalone, so usage errors get its short message and exit code 2; our own
    errors (and bad files or values) are reported here as one line with exit code 1.
    """
    _register()
    try:
        app(args=argv, prog_name="sessionstore")
    except SystemExit as exc:
        if exc.code not in (0, None):  # click ends every successful run with exit(0)
            raise
    except SessionStoreError as exc:
        _fail(exc.message)
    except (OSError, ValueError) as exc:
        _fail(str(exc))


def _fail(message: str) -> None:
    err_console.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    sys.exit(1)
