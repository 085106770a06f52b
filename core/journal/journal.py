"""The event journal: sessions, append-only events, idempotency records and the manifest.

All journal SQL lives here. Both backends share it; what differs is how a write transaction
serializes against the others (see ``serialize_writers``), which is what keeps the global
position safe to follow (DESIGN invariant 4).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Connection,
    Select,
    String,
    delete,
    func,
    insert,
    literal,
    select,
    true,
    update,
)
from sqlalchemy.exc import IntegrityError

from core import exact_json
from core.db import (
    advisory_lock,
    is_sqlite,
    keyset_pages,
    read_connection,
    retry_deadlocks,
    write_transaction,
)
from core.errors import (
    BlobsMissing,
    ConcurrencyConflict,
    InvalidEvent,
    SessionStoreError,
)
from core.journal import manifest
from core.journal.postgres import (
    PG_NEXT_POSITIONS,
    SQLITE_LAST_POSITION,
    WRITER_LOCK_KEY,
    run_append,
    session_events,
)
from core.journal.sessions import MAX_READ_PAGE, SessionRows
from core.journal.validation import check_limit, check_names, check_seq
from core.models import (
    ROLLUP_LOCK,
    BlobRefRow,
    BlobRow,
    EventRollupRow,
    EventRow,
    ImportOffsetRow,
    SessionRow,
    TZDateTime,
    WriteRow,
    table_of,
    utcnow,
)
from core.records import (
    AppendResult,
    ManifestEntry,
    PreparedEvent,
    StoredEvent,
)
from core.translate import translated

_sessions = table_of(SessionRow)
_events = table_of(EventRow)
_writes = table_of(WriteRow)
_refs = table_of(BlobRefRow)
_blobs = table_of(BlobRow)
_offsets = table_of(ImportOffsetRow)
_rollups = table_of(EventRollupRow)

_EVENT_COLUMNS = (
    _events.c.session_id,
    _events.c.seq,
    _events.c.position,
    _events.c.type,
    _events.c.payload,
    _events.c.recorded_at,
)


def _to_event(row: Any) -> StoredEvent:
    return StoredEvent(
        session_id=row.session_id,
        seq=row.seq,
        position=row.position,
        type=row.type,
        payload=row.payload,
        recorded_at=row.recorded_at,
    )


def _write_of(session_id: str, row: Any) -> AppendResult:
    """A ``writes`` row as the result a replay of its write answers."""
    return AppendResult(session_id, row.first_seq, row.last_seq, list(row.positions), True)


def numbered_write_query(session_id: str, key_prefix: str, below: int) -> Select[Any]:
    """``Journal.latest_numbered_write``'s query. A number is decimal without a leading zero
    (keys with other text after the prefix are no numbered write's), so one below ``below``
    has fewer digits, or as many and sorts before it."""
    key = _writes.c.idempotency_key
    bound = f"{key_prefix}{below}"
    shorter = func.length(key) < len(bound)
    before = (func.length(key) == len(bound)) & (key < bound)
    return (
        select(_writes)
        .where(
            _writes.c.session_id == session_id,
            key.regexp_match(f"^{re.escape(key_prefix)}(0|[1-9][0-9]*)\\Z"),
            shorter | before,
        )
        .order_by(_writes.c.first_seq.desc())
        .limit(1)
    )


def _batch_json(events: Sequence[PreparedEvent]) -> str:
    """The batch's payloads as one JSON array, reusing each event's JSON where it has one
    (``json_array_elements`` passes each element's text on unchanged: it is what is stored)."""
    parts = [
        ev.encoded if ev.encoded is not None else exact_json.dumps(ev.payload) for ev in events
    ]
    return (b"[" + b",".join(parts) + b"]").decode()


class Journal(SessionRows):
    """Sessions (``SessionRows``), append-only events, the manifest and idempotency."""

    # writes -----------------------------------------------------------------------------

    @translated
    def append(
        self,
        session_id: str,
        events: Sequence[PreparedEvent],
        *,
        expected_seq: int | None = None,
        idempotency_key: str | None = None,
        before: Callable[[Connection], Collection[str]] | None = None,
    ) -> AppendResult:
        """Append ``events`` to a session, atomically (invariants 3-5).

        ``before`` runs first inside the append's transaction (the writer registers the
        batch's new blobs there) and returns the blob hashes it holds locked: those need no
        second check. A transaction chosen as a deadlock victim runs again.
        """
        if idempotency_key is not None and not 0 < len(idempotency_key) <= 200:
            raise InvalidEvent("idempotency_key", "must be 1..200 characters")
        single_statement = (
            not is_sqlite(self.engine) and before is None and not any(ev.refs for ev in events)
        )

        def attempt() -> AppendResult:
            with self._append_connection(single_statement) as conn:
                held = before(conn) if before is not None else ()
                return self._append_in(
                    conn, session_id, events, expected_seq, idempotency_key, held
                )

        try:
            return retry_deadlocks(attempt)
        except IntegrityError as exc:
            # The one place a unique-key violation becomes a domain answer: the same key
            # committed by a concurrent writer is a replay; anything else is a conflict.
            if idempotency_key is not None:
                prior = self.find_write(session_id, idempotency_key)
                if prior is not None:
                    return prior
            head = self.get_session(session_id).head_seq
            expected = expected_seq if expected_seq is not None else head
            raise ConcurrencyConflict(session_id, expected, head) from exc

    @contextmanager
    def _append_connection(self, single_statement: bool) -> Iterator[Connection]:
        """A write transaction, or (PostgreSQL, no blob refs) an autocommit connection.

        Without refs the PostgreSQL append is one statement: atomic on its own, so running
        it in autocommit saves the BEGIN and COMMIT round trips. Its advisory lock is still
        released only after the commit is visible, so positions still commit in order.
        """
        if not single_statement:
            with write_transaction(self.engine) as conn:
                yield conn
            return
        with self.engine.connect() as conn:
            yield conn.execution_options(isolation_level="AUTOCOMMIT")

    def _append_in(
        self,
        conn: Connection,
        session_id: str,
        events: Sequence[PreparedEvent],
        expected_seq: int | None,
        idempotency_key: str | None,
        held: Collection[str] = (),
    ) -> AppendResult:
        self._require_blobs(conn, {ref.hash for ev in events for ref in ev.refs} - set(held))
        now = utcnow()
        if is_sqlite(self.engine):
            written = self._write_generic(
                conn, session_id, events, expected_seq, idempotency_key, now
            )
        else:
            written = self._write_postgres(
                conn, session_id, events, expected_seq, idempotency_key, now
            )
        if written is None:
            prior = idempotency_key and self._prior_write(conn, session_id, idempotency_key)
            if prior:
                return prior
            head = self.session_in(conn, session_id).head_seq  # raises SessionNotFound
            raise ConcurrencyConflict(session_id, expected_seq or 0, head)
        first_seq, positions = written
        if is_sqlite(self.engine):  # PostgreSQL's one statement wrote the manifest too
            self._insert_manifest(conn, session_id, positions, [ev.refs for ev in events])
        return AppendResult(session_id, first_seq, first_seq + len(events) - 1, positions)

    def _write_generic(
        self,
        conn: Connection,
        session_id: str,
        events: Sequence[PreparedEvent],
        expected_seq: int | None,
        idempotency_key: str | None,
        now: datetime,
    ) -> tuple[int, list[int]] | None:
        """Claim seqs on the session row, then insert the events and the write record."""
        self.serialize_writers(conn)
        if idempotency_key is not None and self._prior_write(conn, session_id, idempotency_key):
            return None
        count = len(events)
        claim = update(_sessions).where(_sessions.c.id == session_id)
        if expected_seq is not None:
            claim = claim.where(_sessions.c.head_seq == expected_seq)
        row = conn.execute(
            claim.values(head_seq=_sessions.c.head_seq + count, updated_at=now).returning(
                _sessions.c.head_seq
            )
        ).first()
        if row is None:
            return None
        first_seq = row.head_seq - count + 1
        positions = self.insert_events(
            conn,
            session_id,
            [(first_seq + i, ev.type, ev.payload, ()) for i, ev in enumerate(events)],
            recorded_at=now,
        )
        if idempotency_key is not None:
            conn.execute(
                insert(_writes).values(
                    session_id=session_id,
                    idempotency_key=idempotency_key,
                    first_seq=first_seq,
                    last_seq=row.head_seq,
                    positions=positions,
                    created_at=now,
                )
            )
        return first_seq, positions

    def _write_postgres(
        self,
        conn: Connection,
        session_id: str,
        events: Sequence[PreparedEvent],
        expected_seq: int | None,
        idempotency_key: str | None,
        now: datetime,
    ) -> tuple[int, list[int]] | None:
        """The same write as one statement: a round trip per append, whatever the batch."""
        refs = [
            {"ord": i, "pointer": r.pointer, "hash": r.hash, "size": r.size, "encoding": r.encoding}
            for i, ev in enumerate(events, start=1)
            for r in ev.refs
        ]
        rows = run_append(
            conn,
            idempotency_key is not None,
            bool(refs),
            {
                "sid": session_id,
                "n": len(events),
                "expected": expected_seq,
                "now": now,
                # One JSON document for the whole batch: a text[]/jsonb[] parameter would
                # be escaped element by element on the client, a regex per string.
                "payloads": _batch_json(events),
                "types": [ev.type for ev in events],
                "key": idempotency_key,
                "lock_key": WRITER_LOCK_KEY,
                "refs": exact_json.dumps(refs).decode() if refs else None,
            },
        )
        if not rows:
            return None
        return rows[0][1], [position for position, _ in rows]

    def serialize_writers(self, conn: Connection) -> None:
        """Make positions commit in order: one event writer at a time, until its commit.

        SQLite's BEGIN IMMEDIATE already holds the database write lock. On PostgreSQL every
        event insert takes the same transaction-scoped advisory lock (the one-statement
        append takes it inside its statement); readers never wait for it.
        """
        advisory_lock(conn, WRITER_LOCK_KEY)

    def _require_blobs(self, conn: Connection, hashes: set[str]) -> None:
        """Blob before reference (invariants 2 and 6): every referenced blob is registered.

        On PostgreSQL the rows are share-locked until this write commits, so GC (which takes
        the row's update lock and re-checks references) cannot delete them in between; on
        SQLite the write transaction already excludes GC. A missing row raises
        ``BlobsMissing``, and the writer re-creates the blob and retries.
        """
        if not hashes:
            return
        # Locked in hash order, as BlobIndex.refresh does: no lock-order deadlock with puts.
        query = (
            select(_blobs.c.hash).where(_blobs.c.hash.in_(sorted(hashes))).order_by(_blobs.c.hash)
        )
        if not is_sqlite(self.engine):
            query = query.with_for_update(read=True)
        missing = hashes - set(conn.execute(query).scalars())
        if missing:
            raise BlobsMissing(missing)

    def insert_events(
        self,
        conn: Connection,
        session_id: str,
        rows: Sequence[tuple[int, str, dict[str, Any], Sequence[ManifestEntry]]],
        *,
        recorded_at: datetime,
    ) -> list[int]:
        """Insert (seq, type, payload, refs) rows and their manifest; return their positions.

        Callers hold a write transaction that has serialized writers.
        """
        positions = self._allocate_positions(conn, len(rows))
        conn.execute(
            insert(_events),
            [
                {
                    "position": position,
                    "session_id": session_id,
                    "seq": seq,
                    "type": kind,
                    "payload": payload,
                    "recorded_at": recorded_at,
                }
                for position, (seq, kind, payload, _) in zip(positions, rows, strict=True)
            ],
        )
        self._insert_manifest(conn, session_id, positions, [refs for *_, refs in rows])
        return positions

    def _insert_manifest(
        self,
        conn: Connection,
        session_id: str,
        positions: Sequence[int],
        refs_per_event: Sequence[Sequence[ManifestEntry]],
    ) -> None:
        manifest = [
            {
                "position": position,
                "session_id": session_id,
                "pointer": ref.pointer,
                "hash": ref.hash,
                "size": ref.size,
                "encoding": ref.encoding,
            }
            for position, refs in zip(positions, refs_per_event, strict=True)
            for ref in refs
        ]
        if manifest:
            conn.execute(insert(_refs), manifest)

    def _allocate_positions(self, conn: Connection, count: int) -> list[int]:
        """Positions for ``count`` events, taken while this transaction serializes writers.

        Allocating up front (instead of INSERT … RETURNING) lets the insert run as one
        pipelined executemany; positions are still never reused and follow commit order.
        """
        if is_sqlite(self.engine):
            last = conn.execute(SQLITE_LAST_POSITION).scalar()
            start = int(last or 0) + 1
            return list(range(start, start + count))
        values = conn.execute(
            PG_NEXT_POSITIONS,
            {"n": count},
        ).scalars()
        return sorted(int(v) for v in values)

    def copy_events(
        self,
        conn: Connection,
        parent_id: str,
        fork_id: str,
        upto: int,
        *,
        recorded_at: datetime,
    ) -> None:
        """A fork's events 1..upto and their manifest rows, copied inside the database.

        Callers hold a write transaction that has serialized writers.

        Two INSERT … SELECT statements: the payloads never travel to Python and back, which
        keeps the writers' lock (every append of every session waits for it) short. The
        positions come from the position sequence (SQLite: AUTOINCREMENT) in seq order, as
        the one-statement append's do, while this transaction holds the writers' lock
        (invariant 4). ``recorded_at`` is the fork's time: when these rows were recorded.
        The copies are marked ``inherited`` (the parent's own rows, or its own inherited
        ones, hold the same events), so analytics can count each event once.
        """
        conn.execute(
            insert(_events).from_select(
                ["session_id", "seq", "type", "payload", "recorded_at", "inherited"],
                select(
                    literal(fork_id, String),
                    _events.c.seq,
                    _events.c.type,
                    _events.c.payload,
                    literal(recorded_at, TZDateTime),
                    true(),
                )
                .where(_events.c.session_id == parent_id, _events.c.seq <= upto)
                .order_by(_events.c.seq),
            )
        )
        copied = conn.execute(
            select(func.count()).where(_events.c.session_id == fork_id)
        ).scalar_one()
        if copied != upto:
            raise SessionStoreError(f"session {parent_id}: {copied} events up to seq {upto}")
        parent, child = _events.alias("parent"), _events.alias("child")
        conn.execute(
            insert(_refs).from_select(
                ["position", "session_id", "pointer", "hash", "size", "encoding"],
                select(
                    child.c.position,
                    literal(fork_id, String),
                    _refs.c.pointer,
                    _refs.c.hash,
                    _refs.c.size,
                    _refs.c.encoding,
                )
                .select_from(
                    _refs.join(parent, parent.c.position == _refs.c.position).join(
                        child, (child.c.session_id == fork_id) & (child.c.seq == parent.c.seq)
                    )
                )
                .where(_refs.c.session_id == parent_id, parent.c.seq <= upto)
                .order_by(child.c.position, _refs.c.id),
            )
        )

    def _prior_write(self, conn: Connection, session_id: str, key: str) -> AppendResult | None:
        row = conn.execute(
            select(_writes).where(
                _writes.c.session_id == session_id, _writes.c.idempotency_key == key
            )
        ).first()
        return None if row is None else _write_of(session_id, row)

    @translated
    def find_write(self, session_id: str, key: str) -> AppendResult | None:
        with read_connection(self.engine) as conn:
            return self._prior_write(conn, session_id, key)

    @translated
    def latest_numbered_write(
        self, session_id: str, key_prefix: str, *, below: int
    ) -> tuple[int, AppendResult] | None:
        """Of a session's writes keyed ``key_prefix`` and a number, the latest (greatest
        ``first_seq``) whose number is below ``below``, with its number; None if none is.
        One query, along ``ix_writes_session_first_seq`` from the latest write back."""
        if below <= 0:
            return None
        with read_connection(self.engine) as conn:
            row = conn.execute(numbered_write_query(session_id, key_prefix, below)).first()
        if row is None:
            return None
        return int(row.idempotency_key[len(key_prefix) :]), _write_of(session_id, row)

    # reads ------------------------------------------------------------------------------

    @translated
    def read(
        self,
        session_id: str,
        *,
        after_seq: int = 0,
        upto_seq: int | None = None,
        limit: int | None = None,
        tenant_id: str | None = None,
    ) -> list[StoredEvent]:
        check_seq(after_seq, "after_seq")
        if upto_seq is not None:
            check_seq(upto_seq, "upto_seq")
        if limit is not None:
            check_limit(limit)
        with read_connection(self.engine) as conn:
            if tenant_id is not None:
                self.session_in(conn, session_id, tenant_id=tenant_id)
            events = self._session_events(conn, session_id, after_seq, upto_seq, limit)
            if not events and tenant_id is None:
                self.session_in(conn, session_id)
        return events

    def _session_events(
        self,
        conn: Connection,
        session_id: str,
        after_seq: int,
        upto_seq: int | None,
        limit: int | None,
    ) -> list[StoredEvent]:
        if not is_sqlite(self.engine):
            return session_events(
                conn, session_id, after_seq=after_seq, upto_seq=upto_seq, limit=limit
            )
        query = (
            select(*_EVENT_COLUMNS)
            .where(_events.c.session_id == session_id, _events.c.seq > after_seq)
            .order_by(_events.c.seq)
        )
        if upto_seq is not None:
            query = query.where(_events.c.seq <= upto_seq)
        if limit is not None:
            query = query.limit(limit)
        return [_to_event(r) for r in conn.execute(query)]

    def iter_events(
        self,
        session_id: str,
        *,
        after_seq: int = 0,
        upto_seq: int | None = None,
        page_size: int = 2000,
        tenant_id: str | None = None,
    ) -> Iterator[StoredEvent]:
        """All events of a session in seq order, fetched a page at a time."""

        def fetch(cursor: int, size: int) -> list[StoredEvent]:
            return self.read(
                session_id, after_seq=cursor, upto_seq=upto_seq, limit=size, tenant_id=tenant_id
            )

        return keyset_pages(fetch, lambda e: e.seq, after=after_seq, size=page_size)

    @translated
    def read_all(
        self,
        *,
        after_position: int = 0,
        limit: int = 1000,
        tenant_id: str | None = None,
        types: Sequence[str] | None = None,
    ) -> list[StoredEvent]:
        check_seq(after_position, "after_position")
        limit = min(check_limit(limit), MAX_READ_PAGE)
        check_names(types, "types")
        query = (
            select(*_EVENT_COLUMNS)
            .where(_events.c.position > after_position)
            .order_by(_events.c.position)
            .limit(limit)
        )
        if tenant_id is not None:
            query = query.join(_sessions, _sessions.c.id == _events.c.session_id).where(
                _sessions.c.tenant_id == tenant_id
            )
        if types:
            query = query.where(_events.c.type.in_(list(types)))
        with read_connection(self.engine) as conn:
            rows = conn.execute(query).all()
        return [_to_event(r) for r in rows]

    def manifest(self, positions: Sequence[int]) -> dict[int, list[ManifestEntry]]:
        """Manifest rows of these event positions, keyed by position."""
        return manifest.of_positions(self.engine, positions)

    def manifest_of(self, events: Sequence[StoredEvent]) -> dict[int, list[ManifestEntry]]:
        """Manifest rows of these events, keyed by position: one query per session."""
        return manifest.of_events(self.engine, events)

    def blob_places(
        self,
        session_id: str,
        hashes: Collection[str],
        *,
        pointers: Collection[str],
        upto_seq: int,
    ) -> list[tuple[int, ManifestEntry]]:
        """(seq, row) of the session's manifest rows up to ``upto_seq`` that place one of
        these blobs at one of these pointers."""
        return manifest.places_of_hashes(
            self.engine, session_id, hashes, pointers=pointers, upto_seq=upto_seq
        )

    def blob_hashes(self, session_id: str) -> set[str]:
        """Every blob the session's events reference, by its manifest."""
        return manifest.hashes_of_session(self.engine, session_id)

    def delete_events_of(self, conn: Connection, session_id: str) -> None:
        """Remove a whole session's events, manifest and stats rollup (only with the session
        itself)."""
        conn.execute(delete(_refs).where(_refs.c.session_id == session_id))
        conn.execute(delete(_writes).where(_writes.c.session_id == session_id))
        conn.execute(delete(_events).where(_events.c.session_id == session_id))
        advisory_lock(conn, ROLLUP_LOCK)  # no roll-up meanwhile (see ROLLUP_LOCK)
        conn.execute(delete(_rollups).where(_rollups.c.session_id == session_id))
        conn.execute(delete(_offsets).where(_offsets.c.session_id == session_id))
