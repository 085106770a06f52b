"""``sessionstore db``: upgrade, downgrade, current revision, history and an up-to-date check.

Every command but ``upgrade`` is read-only: on a missing embedded database it fails with
DatabaseMissing instead of creating one.
"""

from __future__ import annotations

import typer

from core.errors import SchemaAhead
from tasks.cli.common import JsonOption, confirm, console, load_settings, new_app, print_json

cli = new_app()

db_app = new_app(help="Schema management (Alembic): upgrade, downgrade, current, history, check.")
cli.add_typer(db_app, name="db")


def _url(*, create: bool = False) -> str:
    from core import migrate

    url = load_settings().resolved_database_url
    if not create:
        migrate.require_database(url)
    return url


@db_app.command("upgrade")
def upgrade(
    revision: str = typer.Argument("head", help="Target revision."), as_json: bool = JsonOption
) -> None:
    """Upgrade the journal schema (default: to head). Creates an embedded database."""
    from core import migrate

    url = _url(create=True)
    migrate.upgrade(url, revision)
    _print_current(url, as_json)


@db_app.command("downgrade")
def downgrade(
    revision: str = typer.Argument(..., help="Target revision (or 'base': drops everything)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    force: bool = typer.Option(
        False,
        "--force",
        help="Go past a step that refuses because the older code cannot rebuild what it "
        "would lose (the refusal says what that is).",
    ),
    as_json: bool = JsonOption,
) -> None:
    """Downgrade the journal schema to REVISION (data in dropped tables is lost). A step
    that would lose more is refused, changing nothing, unless --force."""
    from core import migrate

    url = _url()
    confirm(f"downgrade the schema to {revision}? Dropped tables lose data.", yes=yes)
    migrate.downgrade(url, revision, force=force)
    _print_current(url, as_json)


def _print_current(url: str, as_json: bool) -> None:
    from core import migrate

    rev = migrate.current_revision(url)
    if as_json:
        print_json({"current": rev})
    else:
        console.print(f"schema at {rev or 'base (empty)'}", highlight=False)


# What ``db current`` adds when the schema is not at this code's head.
_NOT_CURRENT = {
    "missing": "no schema: run `sessionstore db upgrade`",
    "behind": "behind: run `sessionstore db upgrade`",
    "ahead": f"ahead: {SchemaAhead.ADVICE}",
}


@db_app.command("current")
def current(as_json: bool = JsonOption) -> None:
    """Show the schema revision of the configured database; exit 8 unless it is at head."""
    from core import migrate
    from tasks.cli.failures import ExitCode

    url = _url()
    rev, head = migrate.current_revision(url), migrate.head_revision(url)
    state = migrate.schema_state(rev)
    if as_json:
        print_json({"current": rev, "head": head, "state": state})
    else:
        said = f" ({_NOT_CURRENT[state]})" if state in _NOT_CURRENT else ""
        console.print(f"current: {rev or 'none'}   head: {head}{said}", highlight=False)
    if state != "current":
        raise typer.Exit(code=int(ExitCode.SCHEMA_NOT_CURRENT))


@db_app.command("history")
def history(as_json: bool = JsonOption) -> None:
    """Every migration, oldest first, marked applied or pending."""
    from core import migrate

    revisions = migrate.history(migrate.current_revision(_url()))
    if as_json:
        print_json([r.to_dict() for r in revisions])
        return
    for r in revisions:
        mark = "applied" if r.applied else "pending"
        typer.echo(f"{r.revision}  {mark:<7}  {r.doc}")


@db_app.command("check")
def check(as_json: bool = JsonOption) -> None:
    """Say "up to date" and exit 0, or list the pending migrations and exit 8."""
    from core import migrate
    from tasks.cli.failures import ExitCode

    url = _url()
    rev = migrate.current_revision(url)
    todo = migrate.pending(rev)
    if as_json:
        print_json({"current": rev, "pending": [r.to_dict() for r in todo]})
    elif not todo:
        typer.echo(f"schema is up to date (at {rev})")
    else:
        typer.echo(f"schema at {rev or 'nothing'}; {len(todo)} migration(s) pending:")
        for r in todo:
            typer.echo(f"  {r.revision}  {r.doc}")
        typer.echo("run `sessionstore db upgrade`")
    if todo:
        raise typer.Exit(code=int(ExitCode.SCHEMA_NOT_CURRENT))
