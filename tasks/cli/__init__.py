"""The ``sessionstore`` command line. Thin: every command calls into ``core`` (or the queue)."""

from __future__ import annotations

import sys

import click
import typer

from core.errors import SessionStoreError
from tasks.cli.common import app, err_console


def _register() -> None:
    # Each module adds its commands to ``app`` when imported.
    from tasks.cli import db, sessions  # noqa: F401


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and a non-zero exit, no traceback."""
    _register()
    command = typer.main.get_command(app)
    try:
        command.main(args=argv, prog_name="sessionstore", standalone_mode=False)
    except click.exceptions.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except SessionStoreError as exc:
        err_console.print(f"error: {exc.message}", markup=False, highlight=False)
        sys.exit(1)
    except (OSError, ValueError) as exc:
        err_console.print(f"error: {exc}", markup=False, highlight=False)
        sys.exit(1)
