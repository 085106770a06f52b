"""The schema, as SQLModel tables. Alembic (migrations/) is the only thing that creates it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    Interval,
    LargeBinary,
    Numeric,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
    func,
    literal,
    select,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Connection, Dialect, Engine
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import Field, SQLModel

from core.db import is_sqlite

# SQLite only aliases the rowid for exactly "INTEGER PRIMARY KEY".
BigIntPK = BigInteger().with_variant(Integer(), "sqlite")
JsonPayload = JSON().with_variant(JSONB(), "postgresql")
# An event's payload is its JSON text on both backends (PostgreSQL ``json``, not ``jsonb``):
# jsonb would reorder keys, drop -0.0 and turn 1e16 into an integer (see core.exact_json).
# Queries use PostgreSQL's json operators on it directly; migration 0009 explains the choice.
EventPayload = JSON()


def as_utc(value: datetime) -> datetime:
    """An aware ``value`` in UTC. Its offset can carry it past the years datetime holds
    (0001-01-01T00:00+01:00): then the nearest end of that range, the same bound for any
    instant a journal can hold."""
    try:
        return value.astimezone(UTC)
    except OverflowError:
        return (datetime.min if value.year == 1 else datetime.max).replace(tzinfo=UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on both backends (SQLite would hand back naive ones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: sessionstore stores UTC-aware datetimes only")
        value = as_utc(value)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


TZDateTime = UTCDateTime()

SESSION_ID_LEN = 36
EXTERNAL_ID_LEN = 200
HASH_LEN = 64


def utcnow() -> datetime:
    return datetime.now(UTC)


def database_clock(engine: Engine, ago: timedelta = timedelta(0)) -> ColumnElement[datetime]:
    """The time ``ago`` before now by the database's clock, as a SQL expression, for times
    that one host writes and another judges (a heartbeat and its staleness). PostgreSQL's
    ``clock_timestamp()`` is one clock for every host that shares the database, so their
    skew never turns a live heartbeat stale; an embedded SQLite database has one host, and
    its clock is that host's."""
    if is_sqlite(engine):
        return literal(utcnow() - ago, TZDateTime)
    now = func.clock_timestamp(type_=DateTime(timezone=True))
    return now - literal(ago, Interval()) if ago else now


def postgres_statement_clock() -> ColumnElement[datetime]:
    """The database's clock (see ``database_clock``) when the statement began: one time
    for every row and column it writes, in a statement built once and run many times
    (where a host's time would be fixed when it was built)."""
    return func.statement_timestamp(type_=DateTime(timezone=True))


def database_now(conn: Connection | Engine) -> datetime:
    """Now by the database's clock (see ``database_clock``), for a time written by one host
    and judged by another when it must be known in Python: an oversized output's
    ``expires_at``, and the moment it is judged against. One query on PostgreSQL (on a
    connection of its own, given an engine)."""
    if is_sqlite(conn.engine):
        return utcnow()
    if isinstance(conn, Engine):
        with conn.connect() as own:
            return database_now(own)
    now = conn.execute(select(func.clock_timestamp())).scalar_one()
    assert isinstance(now, datetime)
    return now.astimezone(UTC)


class SessionRow(SQLModel, table=True):
    __tablename__ = "sessions"
    __table_args__ = (
        Index("ix_sessions_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_sessions_created", "created_at", "id"),  # list_sessions of every tenant
        # the fork reconciler's scan: pending copies, oldest first
        Index("ix_sessions_copy_status_created", "copy_status", "created_at"),
        # an imported session's id in the agent's own files (pi header id), unique per tenant
        UniqueConstraint("tenant_id", "external_id", name="uq_sessions_tenant_external_id"),
    )

    id: str = Field(sa_column=Column(String(SESSION_ID_LEN), primary_key=True))
    tenant_id: str = Field(sa_column=Column(String(128), nullable=False))
    parent_id: str | None = Field(
        default=None, sa_column=Column(String(SESSION_ID_LEN), nullable=True, index=True)
    )
    forked_from_seq: int | None = Field(default=None, sa_column=Column(BigInteger, nullable=True))
    title: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    cwd: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    head_seq: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, default=0))
    # artifact copy of a fork: pending | copied | failed; NULL for sessions that are not forks
    copy_status: str | None = Field(default=None, sa_column=Column(String(16), nullable=True))
    copy_error: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    created_at: datetime = Field(sa_column=Column(TZDateTime, nullable=False))
    updated_at: datetime = Field(sa_column=Column(TZDateTime, nullable=False))
    external_id: str | None = Field(
        default=None, sa_column=Column(String(EXTERNAL_ID_LEN), nullable=True)
    )


class ImportOffsetRow(SQLModel, table=True):
    """How far a session file has been imported: a re-import resumes after ``consumed_bytes``
    once the file's first ``consumed_bytes`` still hash to ``prefix_sha256``."""

    __tablename__ = "import_offsets"

    session_id: str = Field(
        sa_column=Column(String(SESSION_ID_LEN), ForeignKey("sessions.id"), primary_key=True)
    )
    path: str = Field(sa_column=Column(Text, nullable=False))
    format: str = Field(sa_column=Column(String(32), nullable=False))
    consumed_bytes: int = Field(sa_column=Column(BigInteger, nullable=False))
    # complete lines consumed, and events the session holds from the file (header included)
    lines: int = Field(sa_column=Column(BigInteger, nullable=False))
    entries: int = Field(sa_column=Column(BigInteger, nullable=False))
    prefix_sha256: str = Field(sa_column=Column(String(HASH_LEN), nullable=False))
    updated_at: datetime = Field(sa_column=Column(TZDateTime, nullable=False))
    # the lowest header version the file had (pi rewrites a version 1 or 2 file it opens);
    # null: imported before this was recorded
    source_version: int | None = Field(default=None, sa_column=Column(Integer, nullable=True))
    # JSON {file id: stored id} once pi rewrote an imported version-1 file with new ids
    id_map: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    # the parent a pi fork's header names (``parentSession``): its path resolved, and the
    # session id its file name ends with; the parent's import links the child
    parent_path: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    parent_external: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    # JSON list of the blob refs the session was imported without (oh-my-pi); null: not
    # recorded (imported before this was)
    missing_blobs: str | None = Field(default=None, sa_column=Column(Text, nullable=True))


class EventRow(SQLModel, table=True):
    __tablename__ = "events"
    __table_args__ = (
        UniqueConstraint("session_id", "seq", name="uq_events_session_seq"),
        Index("ix_events_type_recorded", "type", "recorded_at"),
        Index("ix_events_recorded", "recorded_at"),
        {"sqlite_autoincrement": True},
    )

    position: int | None = Field(
        default=None, sa_column=Column(BigIntPK, primary_key=True, autoincrement=True)
    )
    session_id: str = Field(
        sa_column=Column(String(SESSION_ID_LEN), ForeignKey("sessions.id"), nullable=False)
    )
    seq: int = Field(sa_column=Column(BigInteger, nullable=False))
    type: str = Field(sa_column=Column(String(256), nullable=False))
    payload: dict[str, Any] = Field(sa_column=Column(EventPayload, nullable=False))
    recorded_at: datetime = Field(sa_column=Column(TZDateTime, nullable=False))
    # A fork's copy of a parent's event (Journal.copy_events): analytics count each event
    # once across a fork tree by leaving these out unless asked (migration 0008).
    inherited: bool = Field(
        default=False,
        sa_column=Column(Boolean, nullable=False, default=False, server_default=false()),
    )


class WriteRow(SQLModel, table=True):
    """The idempotency record of one write, stored in the write's own transaction."""

    __tablename__ = "writes"
    # a session's writes latest first (an import's resume: Journal.latest_numbered_write)
    __table_args__ = (Index("ix_writes_session_first_seq", "session_id", "first_seq"),)

    session_id: str = Field(
        sa_column=Column(
            String(SESSION_ID_LEN), ForeignKey("sessions.id"), primary_key=True, nullable=False
        )
    )
    idempotency_key: str = Field(sa_column=Column(String(200), primary_key=True, nullable=False))
    first_seq: int = Field(sa_column=Column(BigInteger, nullable=False))
    last_seq: int = Field(sa_column=Column(BigInteger, nullable=False))
    positions: list[int] = Field(sa_column=Column(JSON, nullable=False))
    created_at: datetime = Field(sa_column=Column(TZDateTime, nullable=False))


class BlobRow(SQLModel, table=True):
    __tablename__ = "blobs"

    hash: str = Field(sa_column=Column(String(HASH_LEN), primary_key=True))
    size: int = Field(sa_column=Column(BigInteger, nullable=False))
    stored_size: int = Field(sa_column=Column(BigInteger, nullable=False))
    codec: str = Field(sa_column=Column(String(16), nullable=False))
    created_at: datetime = Field(sa_column=Column(TZDateTime, nullable=False))
    last_written_at: datetime = Field(sa_column=Column(TZDateTime, nullable=False, index=True))


class BlobRefRow(SQLModel, table=True):
    """The manifest: which event position references which blob, where, and how encoded."""

    __tablename__ = "blob_refs"
    __table_args__ = (
        UniqueConstraint("position", "pointer", name="uq_blob_refs_position_pointer"),
    )

    id: int | None = Field(
        default=None, sa_column=Column(BigIntPK, primary_key=True, autoincrement=True)
    )
    position: int = Field(
        sa_column=Column(BigInteger, ForeignKey("events.position"), nullable=False)
    )
    session_id: str = Field(sa_column=Column(String(SESSION_ID_LEN), nullable=False, index=True))
    pointer: str = Field(sa_column=Column(Text, nullable=False))
    hash: str = Field(sa_column=Column(String(HASH_LEN), nullable=False, index=True))
    size: int = Field(sa_column=Column(BigInteger, nullable=False))
    encoding: str = Field(sa_column=Column(String(8), nullable=False))


class ArtifactRow(SQLModel, table=True):
    __tablename__ = "artifacts"
    __table_args__ = (
        UniqueConstraint("session_id", "kind", "local_id", name="uq_artifacts_session_kind_id"),
        Index("ix_artifacts_kind_expires", "kind", "expires_at"),
        Index("ix_artifacts_local_id", "local_id"),
        Index("ix_artifacts_state_created", "state", "created_at"),
    )

    id: int | None = Field(
        default=None, sa_column=Column(BigIntPK, primary_key=True, autoincrement=True)
    )
    session_id: str = Field(
        sa_column=Column(String(SESSION_ID_LEN), ForeignKey("sessions.id"), nullable=False)
    )
    # tool_output | agent_output | file | oversized
    kind: str = Field(sa_column=Column(String(16), nullable=False))
    local_id: str = Field(sa_column=Column(String(300), nullable=False))
    name: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    tool_type: str | None = Field(default=None, sa_column=Column(String(64), nullable=True))
    size_bytes: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, default=0))
    media_type: str | None = Field(default=None, sa_column=Column(String(128), nullable=True))
    created_at: datetime = Field(sa_column=Column(TZDateTime, nullable=False))
    created_seq: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, default=0))
    expires_at: datetime | None = Field(default=None, sa_column=Column(TZDateTime, nullable=True))
    summary: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    # complete | writing (a streamed tool output not finalized yet) | truncated (its writer
    # died: expiry recorded the bytes it left, which are not the whole output)
    state: str = Field(
        default="complete",
        sa_column=Column(String(16), nullable=False, default="complete", server_default="complete"),
    )
    # SHA-256 (hex) of the bytes a reader is served (an agent output's markdown), recorded
    # where the bytes were written; None where none was (a row from before, a streamed
    # output expiry settled, an agent output its caller wrote in place)
    sha256: str | None = Field(default=None, sa_column=Column(String(64), nullable=True))
    # SHA-256 (hex) of an agent output's JSONL sidecar, recorded where it was written; None
    # for other kinds, an output without one, and rows from before (then it is not checked)
    sidecar_sha256: str | None = Field(default=None, sa_column=Column(String(64), nullable=True))
    # A row a fork copied from its parent at its creation (not one it allocated or wrote
    # since): what its artifact copy must find in an ancestor (migration 0025)
    inherited: bool = Field(
        default=False,
        sa_column=Column(Boolean, nullable=False, default=False, server_default=false()),
    )


class CounterRow(SQLModel, table=True):
    """Per-session id counters (artifact ids, agent-output ids), allocated atomically."""

    __tablename__ = "counters"

    session_id: str = Field(
        sa_column=Column(
            String(SESSION_ID_LEN), ForeignKey("sessions.id"), primary_key=True, nullable=False
        )
    )
    name: str = Field(sa_column=Column(String(300), primary_key=True, nullable=False))
    value: int = Field(sa_column=Column(BigInteger, nullable=False))


class DeadLetterRow(SQLModel, table=True):
    """A queued write that was rejected, kept verbatim for inspection and replay."""

    __tablename__ = "dead_letters"

    id: int | None = Field(
        default=None, sa_column=Column(BigIntPK, primary_key=True, autoincrement=True)
    )
    idempotency_key: str = Field(sa_column=Column(String(200), nullable=False, index=True))
    session_id: str = Field(sa_column=Column(String(SESSION_ID_LEN), nullable=False, index=True))
    expected_seq: int | None = Field(default=None, sa_column=Column(BigInteger, nullable=True))
    # the original events as JSON text: kept as text so nothing (NUL, NaN) is refused here
    payload: str = Field(sa_column=Column(Text, nullable=False))
    error_type: str = Field(sa_column=Column(String(64), nullable=False))
    error: str = Field(sa_column=Column(Text, nullable=False))
    created_at: datetime = Field(sa_column=Column(TZDateTime, nullable=False, index=True))
    # a message that could not be decoded (or bound to the task): its body byte for byte,
    # with what the broker said it was
    raw_body: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    content_type: str | None = Field(default=None, sa_column=Column(String(128), nullable=True))
    content_encoding: str | None = Field(default=None, sa_column=Column(String(64), nullable=True))


class SnapshotRow(SQLModel, table=True):
    """A fold state of one session at one seq, for one projection version."""

    __tablename__ = "snapshots"

    session_id: str = Field(
        sa_column=Column(
            String(SESSION_ID_LEN), ForeignKey("sessions.id"), primary_key=True, nullable=False
        )
    )
    version: int = Field(sa_column=Column(Integer, primary_key=True, nullable=False))
    seq: int = Field(sa_column=Column(BigInteger, primary_key=True, nullable=False))
    state: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    created_at: datetime = Field(sa_column=Column(TZDateTime, nullable=False))


class MaintenanceRunRow(SQLModel, table=True):
    """One execution of a periodic maintenance job: whether it ran or skipped, and its report."""

    __tablename__ = "maintenance_runs"
    __table_args__ = (Index("ix_maintenance_runs_job_started", "job", "started_at"),)

    id: int | None = Field(
        default=None, sa_column=Column(BigIntPK, primary_key=True, autoincrement=True)
    )
    job: str = Field(sa_column=Column(String(64), nullable=False))
    started_at: datetime = Field(sa_column=Column(TZDateTime, nullable=False))
    finished_at: datetime = Field(sa_column=Column(TZDateTime, nullable=False))
    # False: another process had this period's slot (or was still running the job)
    ran: bool = Field(sa_column=Column(Boolean, nullable=False))
    report: dict[str, Any] = Field(sa_column=Column(JsonPayload, nullable=False))


class EventTimeBlockRow(SQLModel, table=True):
    """For each sealed block of positions (``position // TIME_BLOCK``; sealed once the head
    is past its end, positions committing in order), upper bounds of its events'
    ``recorded_at`` and entry time. Time-bounded listings use it to start near their first
    match instead of at position 1 (``core.query.timeblocks``). Filled lazily by those
    readers; a session deleted later leaves the bounds high, never low."""

    __tablename__ = "event_time_blocks"

    block: int = Field(sa_column=Column(BigInteger, primary_key=True, autoincrement=False))
    max_recorded_at: datetime = Field(sa_column=Column(TZDateTime, nullable=False))
    # the largest entry time (``core.query.entry_time``), epoch ms rounded up; NULL: none has one
    max_entry_ms: int | None = Field(default=None, sa_column=Column(BigInteger, nullable=True))


REHYDRATION_BUILDING, REHYDRATION_DONE = "building", "done"  # RehydrationRow.status


class RehydrationRow(SQLModel, table=True):
    """A rehydrated export of a session at one head, in one format: built once (``status``
    building → done), then reused until its artifact expires."""

    __tablename__ = "rehydrations"

    session_id: str = Field(
        sa_column=Column(String(SESSION_ID_LEN), primary_key=True, nullable=False)
    )
    format: str = Field(sa_column=Column(String(16), primary_key=True, nullable=False))
    head_seq: int = Field(sa_column=Column(BigInteger, primary_key=True, nullable=False))
    status: str = Field(sa_column=Column(String(16), nullable=False))  # building | done
    # the builder's token; a build whose heartbeat stops is taken over
    builder: str = Field(sa_column=Column(String(64), nullable=False))
    heartbeat_at: datetime = Field(sa_column=Column(TZDateTime, nullable=False))
    artifact_id: str | None = Field(default=None, sa_column=Column(String(64), nullable=True))
    result: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    builds: int = Field(default=0, sa_column=Column(Integer, nullable=False, default=0))


class MoveIntentRow(SQLModel, table=True):
    """A session move in progress: committed before its directory is renamed (invariant 12).

    The row goes in the move's final transaction; one that outlives it marks a move a crash
    interrupted, which ``Moves.repair`` completes or rolls back.
    """

    __tablename__ = "session_moves"

    session_id: str = Field(sa_column=Column(String(SESSION_ID_LEN), primary_key=True))
    from_tenant: str = Field(sa_column=Column(String(128), nullable=False))
    to_tenant: str = Field(sa_column=Column(String(128), nullable=False))
    cwd: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    started_at: datetime = Field(sa_column=Column(TZDateTime, nullable=False))


class SessionRemovalRow(SQLModel, table=True):
    """A deleted session's artifact directory not yet known to be removed (invariant 1: a
    delete removes its artifacts with its rows). Written in the delete's transaction, gone
    once the directory is; one that outlives its delete (a crash after the commit, a failing
    disk, S3 away) is removed by the next expiry run.

    ``kind`` "session" is the session's own directory (under ``tenant_id``, its tenant when
    deleted); "moved" its copy under ``tenant_id``, the other tenant of a move a crash
    interrupted; "held" what its parent ``parent_id`` held for it as an unfinished fork,
    found under the parent's tenant when removed (the parent may have moved since)."""

    __tablename__ = "session_removals"

    session_id: str = Field(sa_column=Column(String(SESSION_ID_LEN), primary_key=True))
    kind: str = Field(sa_column=Column(String(16), primary_key=True))
    tenant_id: str = Field(sa_column=Column(String(128), nullable=False))
    parent_id: str | None = Field(
        default=None, sa_column=Column(String(SESSION_ID_LEN), nullable=True)
    )
    deleted_at: datetime = Field(sa_column=Column(TZDateTime, nullable=False))


metadata = SQLModel.metadata


def table_of(model: type[SQLModel]) -> Table:
    """A model's Core table, typed (SQLModel leaves ``__table__`` untyped)."""
    table: Table = model.__table__  # type: ignore[attr-defined]
    return table


class EventRollupBlockRow(SQLModel, table=True):
    """A sealed block of positions whose events are counted in ``event_rollups``
    (``rolled``), or that is always read live (``rolled`` false: its sums overflow SQLite's
    integers). Claimed in the transaction that rolls it up (``core.query.rollups``)."""

    __tablename__ = "event_rollup_blocks"

    block: int = Field(sa_column=Column(BigInteger, primary_key=True, autoincrement=False))
    rolled: bool = Field(sa_column=Column(Boolean, nullable=False))


ROLLUP_KEY = (
    "day",
    "session_id",
    "type",
    "entry_day",
    "model",
    "has_model",
    "assistant",
    "inherited",
)
"""The columns of an ``event_rollups`` row's unique key (``core.query.rollups`` upserts on it)."""

ROLLUP_LOCK = "sessionstore:event_rollups"
"""Roll-ups hold it shared, a session delete exclusively: the upsert locks rollup rows in no
set order, the delete in index order, so the two could deadlock over one session's rows."""


class EventRollupRow(SQLModel, table=True):
    """The rolled-up events of one session on one day (UTC, recorded), grouped by type and,
    for assistant messages, by entry day and model: counts, bytes and ``message.usage``
    sums. Deleted with the session's events; readers count only rows whose session exists.
    ``entry_day`` and ``model`` are '' where they do not apply (``has_model`` tells a
    missing model from an empty one), so the key is unique without NULLs."""

    __tablename__ = "event_rollups"
    __table_args__ = (
        Index("uq_event_rollups_key", *ROLLUP_KEY, unique=True),
        Index("ix_event_rollups_session", "session_id"),
    )

    id: int | None = Field(
        default=None, sa_column=Column(BigIntPK, primary_key=True, autoincrement=True)
    )
    day: str = Field(sa_column=Column(String(10), nullable=False))
    session_id: str = Field(sa_column=Column(String(SESSION_ID_LEN), nullable=False))
    type: str = Field(sa_column=Column(String(256), nullable=False))
    entry_day: str = Field(sa_column=Column(Text, nullable=False))
    model: str = Field(sa_column=Column(Text, nullable=False))
    has_model: bool = Field(sa_column=Column(Boolean, nullable=False))
    assistant: bool = Field(sa_column=Column(Boolean, nullable=False))
    inherited: bool = Field(sa_column=Column(Boolean, nullable=False))
    events: int = Field(sa_column=Column(BigInteger, nullable=False))
    payload_bytes: int = Field(sa_column=Column(BigInteger, nullable=False))
    blob_bytes: int = Field(sa_column=Column(BigInteger, nullable=False))
    responses: int = Field(sa_column=Column(BigInteger, nullable=False))
    # ``message.usage`` sums: exact decimals on PostgreSQL, SQLite's integers or reals
    input: Decimal | None = Field(default=None, sa_column=Column(Numeric, nullable=True))
    output: Decimal | None = Field(default=None, sa_column=Column(Numeric, nullable=True))
    cache_read: Decimal | None = Field(default=None, sa_column=Column(Numeric, nullable=True))
    cache_write: Decimal | None = Field(default=None, sa_column=Column(Numeric, nullable=True))
    total_tokens: Decimal | None = Field(default=None, sa_column=Column(Numeric, nullable=True))
    cost: Decimal | None = Field(default=None, sa_column=Column(Numeric, nullable=True))
