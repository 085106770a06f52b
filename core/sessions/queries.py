"""Queries the session operations share: a session or None, and a session's forks."""

from __future__ import annotations

from sqlalchemy import Connection, select

from core.errors import SessionNotFound
from core.journal import Journal
from core.models import SessionRow, table_of
from core.records import COPY_PENDING, Session

_sessions = table_of(SessionRow)

# Attempts of a move or delete while new forks keep starting copies from the session.
SETTLE_ATTEMPTS = 5


class Unsettled(Exception):
    """A fork copy reads from the directory in question: settle it and try again."""


def session_or_none(conn: Connection, journal: Journal, session_id: str) -> Session | None:
    try:
        return journal.session_in(conn, session_id)
    except SessionNotFound:
        return None


def children(
    conn: Connection, session_id: str, *, statuses: tuple[str, ...] | None = (COPY_PENDING,)
) -> list[str]:
    """Forks of this session (by default those whose copy is pending)."""
    query = select(_sessions.c.id).where(_sessions.c.parent_id == session_id)
    if statuses is not None:
        query = query.where(_sessions.c.copy_status.in_(statuses))
    return [str(v) for v in conn.execute(query.order_by(_sessions.c.created_at)).scalars()]
