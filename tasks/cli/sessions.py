"""``sessionstore sessions``: list and show."""

from __future__ import annotations

import typer
from rich.table import Table

from tasks.cli.common import JsonOption, app, console, open_store, print_json

sessions_app = typer.Typer(no_args_is_help=True, help="Sessions: list, show.")
app.add_typer(sessions_app, name="sessions")


@sessions_app.command("list")
def list_sessions(
    tenant: str | None = typer.Option(None, help="Only this tenant's sessions."),
    limit: int = typer.Option(50, min=1, max=10_000),
    cursor: str | None = typer.Option(None, help="Cursor from a previous page."),
    as_json: bool = JsonOption,
) -> None:
    """List sessions, oldest first, a page at a time."""
    with open_store() as store:
        page = store.list_sessions(tenant_id=tenant, limit=limit, cursor=cursor)
    if as_json:
        print_json({"items": [s.to_dict() for s in page.items], "next_cursor": page.next_cursor})
        return
    table = Table("id", "tenant", "head", "parent", "title", "created")
    for s in page.items:
        table.add_row(
            s.id,
            s.tenant_id,
            str(s.head_seq),
            s.parent_id or "",
            s.title or "",
            s.created_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    console.print(table)
    if page.next_cursor:
        console.print(f"next page: --cursor {page.next_cursor}")


@sessions_app.command("show")
def show(session_id: str, as_json: bool = JsonOption) -> None:
    """Show one session's metadata."""
    with open_store() as store:
        session = store.get_session(session_id)
    if as_json:
        print_json(session.to_dict())
        return
    for key, value in session.to_dict().items():
        console.print(f"[bold]{key}[/]: {value if value is not None else ''}")
