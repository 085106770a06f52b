"""Engines for the two journal backends, and the one way to open a write transaction."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import ConnectionPoolEntry, NullPool

from core import exact_json
from core.entry_clock import SQLITE_FUNCTION, entry_us_of
from core.errors import BadConfig, StoreClosed

_WRITE = "sessionstore_write"
_T = TypeVar("_T")
log = logging.getLogger(__name__)


class _ClosedPool(NullPool):
    """The pool of a closed store: every checkout fails before a connection is made."""

    def _do_get(self) -> ConnectionPoolEntry:
        raise StoreClosed("this SessionStore is closed; open another with from_settings()")


def close_engine(engine: Engine) -> None:
    """Close every pooled connection, and refuse later ones with ``StoreClosed``. A plain
    ``dispose()`` leaves a fresh pool behind: a store used after ``close()`` quietly opened
    connections that nothing closed (the garbage collector found them, tests later)."""
    engine.dispose()
    engine.pool = _ClosedPool(engine.pool._creator)


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
        _configure_sqlite(engine, parsed.database or ":memory:")
        return engine
    # No pre-ping: it costs a round trip per transaction; a dropped connection is
    # invalidated on first use and the write is retried (queue path) or reported.
    return create_engine(url, pool_size=pool_size, max_overflow=2 * pool_size, **common)


def _configure_sqlite(engine: Engine, database: str) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: ConnectionPoolEntry) -> None:
        # Take transaction control from the sqlite3 module so BEGIN IMMEDIATE is ours to emit.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")  # the first read of the file
        except sqlite3.DatabaseError as exc:
            if "file is not a database" not in str(exc):
                raise
            # the path names another kind of file (or one damaged past reading): no retry helps
            raise BadConfig(
                f"the embedded database {database} is not a SQLite database ({exc}): check "
                "SESSIONSTORE_DATA_DIR and SESSIONSTORE_DATABASE_URL"
            ) from None
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()
        # events --since/--until on SQLite (core.query.entry_time)
        dbapi_conn.create_function(SQLITE_FUNCTION, 3, entry_us_of, deterministic=True)

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


@contextmanager
def snapshot_connection(engine: Engine) -> Iterator[Connection]:
    """A read transaction whose statements all see one snapshot: PostgreSQL's repeatable
    read (read committed takes a snapshot per statement); SQLite's deferred transaction in
    WAL mode does so already."""
    with engine.connect() as conn:
        if not is_sqlite(engine):
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
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


def advisory_lock(conn: Connection, key: int | str, *, shared: bool = False) -> None:
    """Hold a named lock until ``conn``'s transaction ends, the same way on both backends
    (``shared``: with other shared holders, excluding an exclusive one).

    PostgreSQL: a transaction-scoped advisory lock (an int key as is, a text key hashed).
    SQLite: nothing to take, because a write transaction (``write_transaction``) already
    holds the database write lock, which excludes every other writer.
    """
    if conn.dialect.name != "postgresql":
        return
    kind = "_shared" if shared else ""
    argument = ":key" if isinstance(key, int) else "hashtext(:key)"
    conn.execute(text(f"SELECT pg_advisory_xact_lock{kind}({argument})"), {"key": key})


_DEADLOCK_RETRIES = 3


def _is_deadlock(exc: OperationalError) -> bool:
    return type(exc.orig).__name__ in {"DeadlockDetected", "SerializationFailure"}


def retry_deadlocks(transaction: Callable[[], _T]) -> _T:
    """Run a transaction again when PostgreSQL picked it as a deadlock victim."""
    for attempt in range(1, _DEADLOCK_RETRIES + 1):
        try:
            return transaction()
        except OperationalError as exc:
            if attempt == _DEADLOCK_RETRIES or not _is_deadlock(exc):
                raise
            log.warning("transaction deadlocked; retrying", extra={"attempt": attempt})
    raise AssertionError("unreachable")
