"""``sessionstore read URL``: artifact://, agent://, art_… and blob:sha256:… resolution."""

from __future__ import annotations

import sys

import typer

from tasks.cli.common import JsonOption, check_tenant, new_app, open_store, print_json

cli = new_app()


@cli.command("read")
def read(
    url: str = typer.Argument(
        ..., help="artifact://N, agent://ID[/path|?q=…], art_…, blob:sha256:…"
    ),
    session_id: str = typer.Option(
        ..., "--session", "-s", help="The session the URL is in (its id, or the agent's own)."
    ),
    tenant: str | None = typer.Option(
        None, callback=check_tenant, help="Read as this tenant (isolation check)."
    ),
    offset: int | None = typer.Option(None, min=1, help="First line (1-based), plain reads."),
    limit: int | None = typer.Option(None, min=1, help="Number of lines, plain reads."),
    partial: bool = typer.Option(
        False,
        "--partial",
        help="Print a tool output that is not whole (its writer unfinished or dead) as far "
        "as it was saved, with a note, instead of failing.",
    ),
    as_json: bool = JsonOption,
) -> None:
    """Print what a URL resolves to."""
    with open_store() as store:
        session_id = store.resolve_session(session_id, tenant_id=tenant).id
        found = store.resolve(
            url,
            session_id=session_id,
            tenant_id=tenant,
            offset=offset,
            limit=limit,
            partial=partial,
        )
    if as_json:
        content = found.content
        print_json(
            {
                "url": found.url,
                "content_type": found.content_type,
                "size": found.size,
                "notes": list(found.notes),
                "complete": found.complete,
                "content": content if isinstance(content, str) else None,
            }
        )
        return
    if isinstance(found.content, bytes):
        sys.stdout.buffer.write(found.content)
    else:
        sys.stdout.write(found.content)
        if not found.content.endswith("\n"):
            sys.stdout.write("\n")
    for note in found.notes:
        typer.echo(f"# {note}", err=True)
