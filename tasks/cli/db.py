"""``sessionstore db``: schema upgrade, current revision, and an is-up-to-date check."""

from __future__ import annotations

import typer

from core import migrate
from tasks.cli.common import JsonOption, app, console, load_settings, print_json

db_app = typer.Typer(no_args_is_help=True, help="Schema management (Alembic).")
app.add_typer(db_app, name="db")


@db_app.command("upgrade")
def upgrade(revision: str = typer.Argument("head")) -> None:
    """Upgrade the journal schema (default: to head)."""
    url = load_settings().resolved_database_url
    migrate.upgrade(url, revision)
    console.print(f"schema at {migrate.current_revision(url)}")


@db_app.command("current")
def current(as_json: bool = JsonOption) -> None:
    """Show the schema revision of the configured database."""
    url = load_settings().resolved_database_url
    rev, head = migrate.current_revision(url), migrate.head_revision(url)
    if as_json:
        print_json({"current": rev, "head": head})
    else:
        console.print(f"current: {rev or 'none'}   head: {head}")


@db_app.command("check")
def check() -> None:
    """Exit 0 if the schema is at head, 1 otherwise."""
    url = load_settings().resolved_database_url
    if not migrate.is_current(url):
        raise typer.Exit(code=1)
    console.print("schema is up to date")
