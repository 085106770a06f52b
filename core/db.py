"""Engines for the two journal backends, and the one way to open a write transaction."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.pool import ConnectionPoolEntry

from core import exact_json

_WRITE = "sessionstore_write"
_T = TypeVar("_T")


def make_engine(url: str, *, pool_size: int = 10) -> Engine:
    """Build an engine; on SQLite: WAL, a long busy timeout, and immediate write transactions."""
    parsed = make_url(url)
    # JSON columns round-trip exactly (wide integers included) on both backends.
    common: dict[str, Any] = {
        "json_serializer": exact_json.dumps_str,
        "json_deserializer": exact_json.loads,
    }
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, connect_args={"timeout": 60, "check_same_thread": False}, **common
        )
        _configure_sqlite(engine)
        return engine
    # No pre-ping: it costs a round trip per transaction; a dropped connection is
    # invalidated on first use and the write is retried (queue path) or reported.
    return create_engine(url, pool_size=pool_size, max_overflow=2 * pool_size, **common)


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: ConnectionPoolEntry) -> None:
        # Take transaction control from the sqlite3 module so BEGIN IMMEDIATE is ours to emit.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # Writers take the write lock up front: a deferred transaction that upgrades later
        # gets SQLITE_BUSY at once, without the busy handler ("database is locked").
        immediate = conn.get_execution_options().get(_WRITE, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def is_sqlite(engine: Engine) -> bool:
    return engine.dialect.name == "sqlite"


@contextmanager
def write_transaction(engine: Engine) -> Iterator[Connection]:
    """A read-write transaction. On SQLite it holds the database write lock from its start."""
    with engine.connect() as conn:
        conn = conn.execution_options(**{_WRITE: True})
        with conn.begin():
            yield conn


@contextmanager
def read_connection(engine: Engine) -> Iterator[Connection]:
    with engine.connect() as conn, conn.begin():
        yield conn


def keyset_pages(
    fetch: Callable[[int, int], Sequence[_T]], key: Callable[[_T], int], *, after: int, size: int
) -> Iterator[_T]:
    """Every row after the cursor ``after``, one page of ``size`` at a time (keyset
    pagination: ``fetch(cursor, size)`` returns the rows past ``cursor`` in key order)."""
    cursor = after
    while True:
        page = fetch(cursor, size)
        yield from page
        if len(page) < size:
            return
        cursor = key(page[-1])


def advisory_lock(conn: Connection, key: int | str) -> None:
    """Hold a named lock until ``conn``'s transaction ends, the same way on both backends.

    PostgreSQL: a transaction-scoped advisory lock (an int key as is, a text key hashed).
    SQLite: nothing to take, because a write transaction (``write_transaction``) already
    holds the database write lock, which excludes every other writer.
    """
    if conn.dialect.name != "postgresql":
        return
    if isinstance(key, int):
        conn.execute(_PG_LOCK_INT, {"key": key})
    else:
        conn.execute(_PG_LOCK_TEXT, {"key": key})


_PG_LOCK_INT = text("SELECT pg_advisory_xact_lock(:key)")
_PG_LOCK_TEXT = text("SELECT pg_advisory_xact_lock(hashtext(:key))")


_TRANSIENT_SQLSTATES = {
    "40001",  # serialization_failure
    "40P01",  # deadlock_detected
    "55P03",  # lock_not_available
    "57P01",  # admin_shutdown
    "57P02",  # crash_shutdown
    "57P03",  # cannot_connect_now
    "53300",  # too_many_connections
}


def is_transient_db_error(exc: BaseException) -> bool:
    """A database failure that may succeed on retry (connection loss, serialization, busy)."""
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated:
            return True
        orig = exc.orig
        if isinstance(orig, psycopg.OperationalError):
            return True
        if getattr(orig, "sqlstate", None) in _TRANSIENT_SQLSTATES:
            return True
        if isinstance(orig, sqlite3.OperationalError):
            text_ = str(orig).lower()
            return "locked" in text_ or "busy" in text_
        return isinstance(exc, sa_exc.OperationalError)
    return isinstance(exc, (sa_exc.TimeoutError, psycopg.OperationalError))
