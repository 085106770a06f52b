"""PostgreSQL-only reads of the journal that skip SQLAlchemy's row layer.

A session's events are the hot read of every rebuild: on the 200-turn session of issue 19,
SQLAlchemy's result rows and type processing took about as long as the query and the JSON
decoding together. Here the driver's cursor builds ``StoredEvent``s straight from its
tuples; the payload is decoded once, by the JSON loader the engine installed on the
connection (``core.exact_json.loads``), and psycopg prepares the statement on reuse.
"""

from __future__ import annotations

from datetime import UTC
from typing import Any

from sqlalchemy import Connection

from core.records import StoredEvent

_SESSION_EVENTS = (
    "SELECT session_id, seq, position, type, payload, recorded_at FROM events "
    "WHERE session_id = %s AND seq > %s AND seq <= %s ORDER BY seq LIMIT %s"
)
_NO_LIMIT = 2**62


def session_events(
    conn: Connection, session_id: str, *, after_seq: int, upto_seq: int | None, limit: int | None
) -> list[StoredEvent]:
    """Events of one session with ``after_seq < seq <= upto_seq``, in seq order."""
    driver: Any = conn.connection.driver_connection
    upto = _NO_LIMIT if upto_seq is None else upto_seq
    count = _NO_LIMIT if limit is None else max(0, limit)
    with driver.cursor(binary=True) as cursor:  # ints and timestamps without parsing
        cursor.execute(_SESSION_EVENTS, (session_id, after_seq, upto, count))
        rows = cursor.fetchall()
    return [
        # recorded_at comes in the connection's time zone; the journal speaks UTC
        StoredEvent(sid, seq, position, kind, payload, recorded_at.astimezone(UTC))
        for sid, seq, position, kind, payload, recorded_at in rows
    ]
