"""What every command shares: the Typer app, consoles, the store, and output helpers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import pydantic
import typer
from rich.console import Console

from core.settings import Settings
from core.store import SessionStore

app = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    help="Event-sourced storage for AI coding-agent sessions.",
)
console = Console()
err_console = Console(stderr=True)

JsonOption = typer.Option(False, "--json", help="Machine-readable JSON output.")


def load_settings() -> Settings:
    try:
        return Settings()
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "settings"
        raise typer.BadParameter(f"{where}: {first.get('msg')}") from None


@contextmanager
def open_store() -> Iterator[SessionStore]:
    with SessionStore.from_settings(load_settings()) as store:
        yield store


def print_json(value: Any) -> None:
    typer.echo(orjson.dumps(value, default=str, option=orjson.OPT_INDENT_2).decode())
