"""Session rows of the journal: create, look up (by id or external id), list with a cursor.

``Journal`` inherits these; they are apart only to keep each module readable.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, insert, literal, select, tuple_
from sqlalchemy.exc import IntegrityError

from core.db import read_connection, write_transaction
from core.errors import ExternalIdTaken, InvalidArgument, InvalidEvent, SessionNotFound
from core.fsio import ESCAPED_KEY, key_text
from core.journal.validation import check_limit, check_name
from core.models import EXTERNAL_ID_LEN, SessionRow, table_of, utcnow
from core.records import Page, Session, from_row
from core.translate import translated

_NUL = "\x00"

_sessions = table_of(SessionRow)
MAX_READ_PAGE = 10_000  # the most rows one read returns


def _to_session(row: Any) -> Session:
    return from_row(Session, row)


def _encode_cursor(created_at: datetime, session_id: str) -> str:
    raw = f"{created_at.isoformat()}|{session_id}".encode()
    return base64.urlsafe_b64encode(raw).decode()


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        stamp, session_id = base64.urlsafe_b64decode(cursor.encode()).decode().split("|", 1)
        created_at = datetime.fromisoformat(stamp)
        if created_at.tzinfo is None:  # the cursors issued name their zone
            raise ValueError("naive timestamp")
        if "\x00" in session_id:  # no session id holds one (PostgreSQL refused the query)
            raise ValueError("U+0000 in the session id")
        return created_at, session_id
    except (ValueError, UnicodeDecodeError) as exc:
        shown = cursor if len(cursor) <= 80 else f"{cursor[:60]}... ({len(cursor):,} characters)"
        raise InvalidArgument("cursor", f"not a cursor this store issued: {shown!r}") from exc


class SessionRows:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @translated
    def create_session(
        self,
        *,
        tenant_id: str,
        title: str | None = None,
        cwd: str | None = None,
        session_id: str | None = None,
        external_id: str | None = None,
        with_row: Callable[[Connection, str], None] | None = None,
    ) -> Session:
        """A new session. ``with_row(conn, session_id)`` runs in the same transaction (an
        import records its file there: no one sees the session without it)."""
        if not tenant_id or len(tenant_id) > 128:
            raise InvalidEvent("tenant_id", "must be 1..128 characters")
        if external_id is not None and not 0 < len(external_id) <= EXTERNAL_ID_LEN:
            raise InvalidEvent("external_id", f"must be 1..{EXTERNAL_ID_LEN} characters")
        fields = {"tenant_id": tenant_id, "title": title, "cwd": cwd, "external_id": external_id}
        for name, value in fields.items():
            # PostgreSQL ``text`` cannot hold it; SQLite could: refused on every backend
            if value is not None and _NUL in value:
                raise InvalidEvent(name, "contains U+0000, which a session's fields cannot hold")
            check_name(value, name)  # a lone surrogate: no database text holds one
        now = utcnow()
        values = {
            "id": session_id or str(uuid.uuid4()),
            "tenant_id": tenant_id,
            "title": title,
            "cwd": cwd,
            "head_seq": 0,
            "created_at": now,
            "updated_at": now,
            "external_id": external_id,
        }
        try:
            with write_transaction(self.engine) as conn:
                conn.execute(insert(_sessions).values(values))
                if with_row is not None:
                    with_row(conn, str(values["id"]))
        except IntegrityError as exc:
            if external_id is not None and self.find_external(tenant_id, external_id):
                raise ExternalIdTaken(tenant_id, external_id) from exc
            raise
        return self.get_session(str(values["id"]))

    def find_external(self, tenant_id: str | None, external_id: str) -> Session | None:
        """The session with this external id (in the tenant; or the only one, if None)."""
        found = self._with_external_id(tenant_id, external_id, limit=2)
        return found[0] if len(found) == 1 else None

    @translated
    def _with_external_id(
        self, tenant_id: str | None, external_id: str, *, limit: int
    ) -> list[Session]:
        """Up to ``limit`` sessions with this external id (in the tenant), by tenant."""
        if _NUL in external_id:  # no session has one (``create_session``); PostgreSQL
            return []  # would refuse the query itself
        query = select(_sessions).where(_sessions.c.external_id == external_id)
        if tenant_id is not None:
            query = query.where(_sessions.c.tenant_id == tenant_id)
        with read_connection(self.engine) as conn:
            rows = conn.execute(query.order_by(_sessions.c.tenant_id).limit(limit)).all()
        return [_to_session(row) for row in rows]

    def resolve_session(self, ref: str, *, tenant_id: str | None = None) -> Session:
        """A session by its id or, failing that, by its external id within the tenant."""
        try:
            return self.get_session(ref, tenant_id=tenant_id)
        except SessionNotFound:
            # as stored; else the id an import keys by it (``key_text``); else an escaped
            # key as shown, without its mark
            key = key_text(ref)
            for candidate in (ref, key if key != ref else ESCAPED_KEY + ref):
                found = self._with_external_id(tenant_id, candidate, limit=6)
                if found:
                    break
            if len(found) == 1:
                return found[0]
            if found:  # not "not found": found in more than one tenant
                tenants = [session.tenant_id for session in found]
                shown = ", ".join(tenants[:5]) + (", ..." if len(tenants) > 5 else "")
                raise InvalidArgument(
                    "session",
                    f"the external id {ref!r} names sessions of several tenants ({shown}): "
                    "give its tenant too (on the command line --tenant; sessions move: "
                    "--from-tenant)",
                ) from None
            raise

    @translated
    def get_session(self, session_id: str, *, tenant_id: str | None = None) -> Session:
        with read_connection(self.engine) as conn:
            return self.session_in(conn, session_id, tenant_id=tenant_id)

    def session_in(
        self, conn: Connection, session_id: str, *, tenant_id: str | None = None
    ) -> Session:
        if _NUL in session_id:  # no session has one; PostgreSQL would refuse the query
            raise SessionNotFound(session_id)
        row = conn.execute(select(_sessions).where(_sessions.c.id == session_id)).first()
        if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
            raise SessionNotFound(session_id)
        return _to_session(row)

    @translated
    def list_sessions(
        self, *, tenant_id: str | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page:
        limit = min(check_limit(limit), MAX_READ_PAGE)
        query = select(_sessions).order_by(_sessions.c.created_at, _sessions.c.id).limit(limit + 1)
        if tenant_id is not None:
            query = query.where(_sessions.c.tenant_id == tenant_id)
        if cursor:
            stamp, last_id = _decode_cursor(cursor)
            # a row comparison: the (created_at, id) indexes serve it as one range
            query = query.where(
                tuple_(_sessions.c.created_at, _sessions.c.id)
                > tuple_(literal(stamp, _sessions.c.created_at.type), last_id)
            )
        with read_connection(self.engine) as conn:
            rows = conn.execute(query).all()
        items = [_to_session(r) for r in rows[:limit]]
        next_cursor = (
            _encode_cursor(items[-1].created_at, items[-1].id) if len(rows) > limit else None
        )
        return Page(items=items, next_cursor=next_cursor)
