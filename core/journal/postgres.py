"""The journal's PostgreSQL statements: the one-statement append, position allocation, and
the session read.

(SQLite runs the generic SQLAlchemy path in ``core.journal.journal``.)

The two hot paths run on the driver's cursor, on the connection SQLAlchemy holds (its
transaction, if any), without SQLAlchemy's statement and row layers:

- The session read: a session's events are the hot read of every rebuild, and on the
  200-turn session of issue 19 SQLAlchemy's result rows and type processing took about as
  long as the query and the JSON decoding together. The driver's cursor builds
  ``StoredEvent``s straight from its tuples; the payload is decoded once, by the JSON loader
  the engine installed on the connection (``core.exact_json.loads``).
- The append (``run_append``): a quarter of a single-event append was SQLAlchemy's cache
  key, bind and result layers. Its errors still leave as SQLAlchemy's.

SQLAlchemy's cursor events (``before_cursor_execute``: statement loggers, SQLAlchemy-level
tracing) do not see these two statements; tracing at the driver (psycopg) does.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC
from functools import cache
from typing import Any, cast

from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError

from core.records import StoredEvent

WRITER_LOCK_KEY = 0x5E5510_0001  # PostgreSQL advisory lock serializing event inserts
PG_NEXT_POSITIONS = text(
    "SELECT nextval(pg_get_serial_sequence('events', 'position')) FROM generate_series(1, :n)"
)
SQLITE_LAST_POSITION = text("SELECT seq FROM sqlite_sequence WHERE name = 'events'")

# PostgreSQL append in one statement, so an append costs the same round trips as a raw
# INSERT: take the writers' lock (the session-row claim depends on it, so positions are
# allocated only while it is held, and it is held until commit), claim seqs on the session
# row (only at the expected head, and only for a key not yet written), insert the batch in
# seq order so positions follow seqs, and (keyed variant) record the write. No row back:
# no session, the head moved, or the key was already written. The types come as an array
# next to the payloads: ``payload ->> 'type'`` parsed every event's text once more (about a
# quarter of the statement's time for a batch of 100 1 KB events).
PG_APPEND_CTES = """
WITH writer_lock AS MATERIALIZED (
    SELECT pg_advisory_xact_lock(%(lock_key)s)
), claimed AS (
    UPDATE sessions SET head_seq = head_seq + %(n)s, updated_at = %(now)s
    WHERE id = %(sid)s AND (CAST(%(expected)s AS BIGINT) IS NULL OR head_seq = %(expected)s)
      AND EXISTS (SELECT 1 FROM writer_lock)
      AND (CAST(%(key)s AS TEXT) IS NULL OR NOT EXISTS (
          SELECT 1 FROM writes WHERE session_id = %(sid)s AND idempotency_key = %(key)s))
    RETURNING head_seq
), inserted AS (
    INSERT INTO events (session_id, seq, type, payload, recorded_at)
    SELECT %(sid)s, claimed.head_seq - %(n)s + e.ord, (CAST(%(types)s AS text[]))[e.ord],
           e.payload, %(now)s
    FROM claimed,
         json_array_elements(CAST(%(payloads)s AS json)) WITH ORDINALITY AS e(payload, ord)
    ORDER BY e.ord
    RETURNING position, seq
)"""
# The batch's manifest rows, in the same statement (a round trip less per append with
# blob refs): each ref names its event by ordinal in the batch. The blob rows themselves
# are upserted (and locked) by a statement before this one, so row locks are always
# taken before the writers' lock.
_PG_MANIFEST = """, manifest AS (
    INSERT INTO blob_refs (position, session_id, pointer, hash, size, encoding)
    SELECT i.position, %(sid)s, r.pointer, r.hash, r.size, r.encoding
    FROM json_to_recordset(CAST(%(refs)s AS json))
         AS r(ord BIGINT, pointer TEXT, hash TEXT, size BIGINT, encoding TEXT)
    JOIN inserted AS i ON i.seq = (SELECT head_seq FROM claimed) - %(n)s + r.ord
)"""
_PG_RECORD = """, recorded AS (
    INSERT INTO writes (session_id, idempotency_key, first_seq, last_seq, positions, created_at)
    SELECT %(sid)s, %(key)s, min(seq), max(seq), to_json(array_agg(position ORDER BY seq)), %(now)s
    FROM inserted HAVING count(*) > 0
)"""
_PG_RESULT = "\nSELECT position, seq FROM inserted ORDER BY seq"
PG_APPEND = {
    (keyed, refs): PG_APPEND_CTES
    + (_PG_MANIFEST if refs else "")
    + (_PG_RECORD if keyed else "")
    + _PG_RESULT
    for keyed in (False, True)
    for refs in (False, True)
}
"""The append statement by (idempotency key given, manifest rows given), in the driver's
parameter style: ``run_append`` runs it on the driver's cursor."""


def run_append(
    conn: Connection, keyed: bool, refs: bool, params: dict[str, Any]
) -> list[tuple[int, int]]:
    """The append statement's (position, seq) rows, run on the driver's cursor (as the session
    read is: see the module). Through SQLAlchemy a single-event append took 1.30 ms, 0.99 ms
    this way: its cache key, bind and result layers were about a quarter of the append. A
    driver error leaves as SQLAlchemy would raise it (``DBAPIError.instance``: the journal's
    deadlock retry, conflict answer and error translation read those), and on a dropped
    connection the pool is renewed first, so it never hands out a dead one."""
    import psycopg  # imported by then: the connection is psycopg's

    driver: Any = conn.connection.driver_connection
    statement = PG_APPEND[keyed, refs]
    try:
        with driver.cursor() as cursor:
            return cast(list[tuple[int, int]], cursor.execute(statement, params).fetchall())
    except psycopg.Error as exc:
        dropped = conn.dialect.is_disconnect(cast(Any, exc), driver, None)
        if dropped:
            # What SQLAlchemy's own error handling does on a disconnect (in
            # Connection._handle_dbapi_exception): every connection the pool opened before
            # now is taken to be gone too (a restarted server) and is replaced at its next
            # checkout, then this one is invalidated.
            conn.engine.pool._invalidate(conn.connection, exc)
            conn.invalidate(exc)
        raise DBAPIError.instance(
            statement, params, exc, psycopg.Error, connection_invalidated=dropped
        ) from exc
    except BaseException as exc:
        if not isinstance(exc, Exception):
            # An exit (SystemExit, KeyboardInterrupt) mid-statement leaves the connection in
            # an unknown state: invalidated, as SQLAlchemy does (this one only).
            conn.invalidate(exc)
        raise


_SESSION_EVENTS = (
    "SELECT session_id, seq, position, type, payload, recorded_at FROM events "
    "WHERE session_id = %s AND seq > %s AND seq <= %s ORDER BY seq LIMIT %s"
)
_NO_LIMIT = 2**62
# The rows come in chunks (libpq >= 17's chunked rows mode) and are decoded as they come:
# the client decodes one chunk's JSON while the server detoasts and sends the next, instead
# of waiting for the whole result in one buffer and then decoding it. On the 200-turn
# session of issue 19 a read took 11 ms instead of 19; for 100,000 small rows 226 ms
# instead of 259 (single-row mode, the older libpq's only streaming, was slower there).
_CHUNK_ROWS = 64


@cache
def _chunked() -> bool:
    import psycopg  # imported by then: the connection is psycopg's

    return psycopg.capabilities.has_stream_chunked()


def session_events(
    conn: Connection, session_id: str, *, after_seq: int, upto_seq: int | None, limit: int | None
) -> list[StoredEvent]:
    """Events of one session with ``after_seq < seq <= upto_seq``, in seq order."""
    driver: Any = conn.connection.driver_connection
    upto = _NO_LIMIT if upto_seq is None else upto_seq
    count = _NO_LIMIT if limit is None else max(0, limit)
    params = (session_id, after_seq, upto, count)
    with driver.cursor(binary=True) as cursor:  # ints and timestamps without parsing
        if not _chunked():
            return _events(cursor.execute(_SESSION_EVENTS, params).fetchall())
        stream = cursor.stream(_SESSION_EVENTS, params, size=_CHUNK_ROWS)
        try:
            return _events(stream)
        finally:
            # On an error mid-stream, cancel and drain the query now: a stream left open
            # holds the connection's lock, and the rollback that follows would wait forever.
            stream.close()


def _events(rows: Iterable[Any]) -> list[StoredEvent]:
    return [
        # recorded_at comes in the connection's time zone; the journal speaks UTC
        StoredEvent(sid, seq, position, kind, payload, recorded_at.astimezone(UTC))
        for sid, seq, position, kind, payload, recorded_at in rows
    ]
