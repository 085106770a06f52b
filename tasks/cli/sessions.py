"""``sessionstore sessions``: list, show, fork, move, delete and copy-artifacts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from tasks.cli.common import (
    INT64_MAX,
    JsonOption,
    TenantOption,
    add_row,
    check_tenant,
    confirm,
    console,
    id_table,
    new_app,
    open_store,
    plain,
    print_fields,
    print_json,
    print_table,
)

if TYPE_CHECKING:
    from core.records import Session

cli = new_app()

sessions_app = new_app(help="Sessions: list, show, fork, move, delete, copy-artifacts.")
cli.add_typer(sessions_app, name="sessions")


@sessions_app.command("list")
def list_sessions(
    tenant: str | None = typer.Option(
        None, callback=check_tenant, help="Only this tenant's sessions."
    ),
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
    table = id_table("id", "tenant", "parent")
    for name in ("head", "copy", "title", "created"):
        table.add_column(name)
    for s in page.items:
        add_row(
            table,
            s.id,
            s.tenant_id,
            s.parent_id,
            str(s.head_seq),
            s.copy_status,
            s.title,
            s.created_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    print_table(table)
    if page.next_cursor:
        console.print(f"next page: --cursor {page.next_cursor}", markup=False, highlight=False)


@sessions_app.command("show")
def show(session_id: str, tenant: str | None = TenantOption, as_json: bool = JsonOption) -> None:
    """Show one session's metadata."""
    with open_store() as store:
        session = store.resolve_session(session_id, tenant_id=tenant)
    if as_json:
        print_json(session.to_dict())
        return
    print_fields(session.to_dict())


# --- fork, move and delete (issue 6) ---


def _print_session(session: Session, as_json: bool, headline: str) -> None:
    if as_json:
        print_json(session.to_dict())
        return
    console.print(plain(headline), highlight=False)
    print_fields(session.to_dict())


@sessions_app.command("fork")
def fork(
    session_id: str,
    at_seq: int | None = typer.Option(
        None, min=0, max=INT64_MAX, help="Fork point (default: the head)."
    ),
    inline: bool = typer.Option(
        False, "--inline", help="Copy the artifacts in this process instead of the queue."
    ),
    tenant: str | None = TenantOption,
    as_json: bool = JsonOption,
) -> None:
    """Fork a session at its head or an earlier seq; its artifacts are copied by a worker
    (status pending, then copied) unless --inline."""
    from tasks.app import get_app
    from tasks.runtime import attach_fork_copier

    with open_store() as store:
        if not inline:
            attach_fork_copier(store, get_app())
        session_id = store.resolve_session(session_id, tenant_id=tenant).id
        session = store.fork(session_id, at_seq=at_seq)
    _print_session(session, as_json, f"forked {session_id} at seq {session.forked_from_seq}")


@sessions_app.command("move")
def move(
    session_id: str,
    tenant: str | None = typer.Option(
        None, callback=check_tenant, help="The tenant to move the session to."
    ),
    cwd: str | None = typer.Option(None, help="The new working directory."),
    from_tenant: str | None = typer.Option(
        None,
        "--from-tenant",
        callback=check_tenant,
        help="The session's tenant now: required where its external id names sessions of several.",
    ),
    as_json: bool = JsonOption,
) -> None:
    """Move a session (metadata and artifact directory together) to a tenant and/or cwd."""
    if tenant is None and cwd is None:
        raise typer.BadParameter("give --tenant and/or --cwd")
    with open_store() as store:
        session_id = store.resolve_session(session_id, tenant_id=from_tenant).id
        session = store.move(session_id, tenant_id=tenant, cwd=cwd)
    _print_session(session, as_json, f"moved {session_id}")


@sessions_app.command("delete")
def delete(
    session_id: str,
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    tenant: str | None = TenantOption,
    as_json: bool = JsonOption,
) -> None:
    """Delete a session: events, manifest rows, artifacts and directory (blobs stay for GC)."""
    with open_store() as store:
        session_id = store.resolve_session(session_id, tenant_id=tenant).id
        confirm(f"delete session {session_id} and all its events and artifacts?", yes=yes)
        report = store.delete_session(session_id)
    if as_json:
        print_json(report.to_dict())
        return
    console.print(
        f"deleted {session_id}: {report.events} events, {report.artifacts} artifacts"
        + (f"; {len(report.forks)} fork(s) keep their own copies" if report.forks else "")
        + (
            ""
            if report.directory_removed
            else "; its artifact directory could not be removed now"
            " (the next expiry run removes it)"
        ),
        markup=False,
        highlight=False,
    )


@sessions_app.command("copy-artifacts")
def copy_artifacts(
    fork_id: str, tenant: str | None = TenantOption, as_json: bool = JsonOption
) -> None:
    """Run a fork's artifact copy now, in this process (also retries a failed copy)."""
    with open_store() as store:
        fork_id = store.resolve_session(fork_id, tenant_id=tenant).id
        report = store.copy_fork_artifacts(fork_id)
    if as_json:
        print_json(report.to_dict())
        return
    console.print(
        f"{fork_id}: {report.status or 'not a fork'}; copied {report.copied} "
        f"({report.bytes_copied:,} B), already present {report.already_present}"
        + (f"\nerror: {report.error}" if report.error else ""),
        markup=False,
        highlight=False,
    )


@sessions_app.command("create")
def create(
    external_id: str | None = typer.Option(
        None, "--id", help="The agent's own id for it (unique per tenant; accepted as an id)."
    ),
    tenant: str = typer.Option("default", callback=check_tenant, help="Tenant of the new session."),
    title: str | None = typer.Option(None, help="Title."),
    cwd: str | None = typer.Option(None, help="Working directory the session belongs to."),
    as_json: bool = JsonOption,
) -> None:
    """Create an empty session."""
    with open_store(create=True) as store:
        session = store.create_session(
            tenant_id=tenant, title=title, cwd=cwd, external_id=external_id
        )
    if as_json:
        print_json(session.to_dict())
    else:
        console.print(session.id, markup=False, highlight=False)


@sessions_app.command("repair")
def repair(
    session_id: str | None = typer.Argument(
        None, help="Only this session's move (its id, or the agent's own) [default: every one]."
    ),
    tenant: str | None = TenantOption,
    as_json: bool = JsonOption,
) -> None:
    """Complete (the directory was renamed) or roll back (it was not) every interrupted move,
    or the session's."""
    with open_store() as store:
        if session_id is not None:
            session_id = store.resolve_session(session_id, tenant_id=tenant).id
        repaired = store.repair_moves(session_id=session_id)
    if as_json:
        print_json({"repaired": [r.to_dict() for r in repaired]})
        return
    if not repaired:
        console.print("nothing to repair")
    for r in repaired:
        console.print(
            f"{r.session_id}: move {r.from_tenant} -> {r.to_tenant} {r.outcome}",
            markup=False,
            highlight=False,
        )
