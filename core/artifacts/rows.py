"""All artifact SQL: the ``artifacts`` and ``counters`` tables, quota locks and usage sums.

Callers pass a connection inside a transaction from ``core.db``; nothing here commits.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, case, delete, func, select, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite

from core.artifacts.records import (
    COMPLETE,
    FILE,
    OVERSIZED,
    TOOL_OUTPUT,
    TRUNCATED,
    WRITING,
    ArtifactInfo,
    ArtifactStats,
)
from core.db import advisory_lock
from core.errors import SessionMoving, SessionNotFound
from core.models import (
    ArtifactRow,
    BlobRefRow,
    CounterRow,
    MoveIntentRow,
    SessionRow,
    database_now,
    table_of,
)
from core.records import from_row

_artifacts = table_of(ArtifactRow)
_counters = table_of(CounterRow)
_sessions = table_of(SessionRow)
_refs = table_of(BlobRefRow)
_moves = table_of(MoveIntentRow)

_QUOTA_LOCK_PREFIX = "sessionstore.artifact-quota:"


@dataclass(frozen=True, slots=True)
class SessionQuotaRow:
    session_id: str
    tenant_id: str
    head_seq: int


def _insert(conn: Connection) -> Any:
    """The dialect's INSERT, which has ``on_conflict_do_update`` on both backends."""
    return postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert


def _to_info(row: Any) -> ArtifactInfo:
    return from_row(ArtifactInfo, row)


# --- sessions -------------------------------------------------------------------------------


def session_info(
    conn: Connection, session_id: str, *, tenant_id: str | None = None
) -> SessionQuotaRow:
    """The session's tenant and head; another tenant's session is not found."""
    row = conn.execute(
        select(_sessions.c.tenant_id, _sessions.c.head_seq).where(_sessions.c.id == session_id)
    ).first()
    if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
        raise SessionNotFound(session_id)
    return SessionQuotaRow(session_id, row.tenant_id, int(row.head_seq))


def lock_tenant(conn: Connection, tenant_id: str) -> None:
    """The tenant's quota lock: quota-bearing writes, forks, moves and deletes take it."""
    advisory_lock(conn, _QUOTA_LOCK_PREFIX + tenant_id)


def lock_quota(conn: Connection, session_id: str) -> SessionQuotaRow:
    """Serialize quota-bearing writes of the session's tenant until the transaction ends.

    SQLite's BEGIN IMMEDIATE already holds the database write lock. On PostgreSQL a
    transaction-scoped advisory lock per tenant makes read-usage/check/write/commit atomic
    against every other writer of that tenant. The tenant is re-read after locking so a
    concurrent tenant move cannot leave us holding the wrong tenant's lock.
    """
    info = session_info(conn, session_id)
    if conn.dialect.name != "postgresql":
        return info
    while True:
        lock_tenant(conn, info.tenant_id)
        current = session_info(conn, session_id)
        if current.tenant_id == info.tenant_id:
            return current
        info = current


# --- where a session's files are: moves --------------------------------------------------------

# A per-session counter every move attempt raises when it records its intent (in that same
# transaction), whether the move then commits, fails and is undone, or crashes. Work that
# touches a session's files outside its tenant's lock (``OversizedOutputs.discard``) reads it
# before and after: equal, with no move pending, means no move touched the directory between.
MOVE_EPOCH = "session-moves"


@dataclass(frozen=True, slots=True)
class SessionPlace:
    """Where a session's files are, read under its tenant lock: the tenant, the move epoch,
    and whether a move is pending (its intent recorded, not yet committed or undone)."""

    tenant_id: str
    epoch: int
    moving: bool


def raise_move_epoch(conn: Connection, session_id: str) -> None:
    """Count a move attempt of the session (in the transaction recording its intent)."""
    next_id(conn, session_id, MOVE_EPOCH)


def session_place(conn: Connection, session_id: str) -> SessionPlace:
    """The session's place, under its tenant's quota lock (taken here); ``SessionNotFound``
    when it is gone."""
    info = lock_quota(conn, session_id)
    epoch = conn.execute(
        select(_counters.c.value).where(
            _counters.c.session_id == session_id, _counters.c.name == MOVE_EPOCH
        )
    ).scalar()
    moving = conn.execute(
        select(_moves.c.session_id).where(_moves.c.session_id == session_id)
    ).first()
    return SessionPlace(info.tenant_id, int(epoch or 0), moving is not None)


def lock_for_write(conn: Connection, session_id: str) -> SessionQuotaRow:
    """``lock_quota`` for a write of the session's files: ``SessionMoving`` while a move of
    it is pending. Its directory may then be renamed already (a crash between the rename
    and the commit leaves the row naming the old one): a file written where the row says
    would re-create the old directory beside the moved one, for the move's repair to find
    two directories. The move's undo runs outside the lock, so this holds until it ends."""
    info = lock_quota(conn, session_id)
    moving = conn.execute(
        select(_moves.c.session_id).where(_moves.c.session_id == session_id)
    ).first()
    if moving is not None:
        raise SessionMoving(session_id)
    return info


# --- counters ---------------------------------------------------------------------------------


def next_id(conn: Connection, session_id: str, name: str) -> int:
    """Allocate the next id of a per-session counter (0, 1, …) atomically.

    The counter row holds how many ids were handed out. The upsert takes the row lock, so
    concurrent allocators in other transactions or processes wait and get distinct ids.
    """
    ins = _insert(conn)(_counters).values(session_id=session_id, name=name, value=1)
    stmt = ins.on_conflict_do_update(
        index_elements=[_counters.c.session_id, _counters.c.name],
        set_={"value": _counters.c.value + 1},
    ).returning(_counters.c.value)
    return int(conn.execute(stmt).scalar_one()) - 1


def set_counter_floor(conn: Connection, session_id: str, name: str, next_value: int) -> None:
    """Make the counter hand out ids >= ``next_value`` from now on (never lowers it).

    A fork uses this to continue numbering after its parent's.
    """
    ins = _insert(conn)(_counters).values(session_id=session_id, name=name, value=next_value)
    raised = case(
        (_counters.c.value < ins.excluded.value, ins.excluded.value), else_=_counters.c.value
    )
    conn.execute(
        ins.on_conflict_do_update(
            index_elements=[_counters.c.session_id, _counters.c.name], set_={"value": raised}
        )
    )


def counter_values(conn: Connection, session_id: str) -> dict[str, int]:
    """Every counter of a session: name -> how many ids were handed out."""
    rows = conn.execute(
        select(_counters.c.name, _counters.c.value).where(_counters.c.session_id == session_id)
    )
    return {r.name: int(r.value) for r in rows}


# --- artifact rows ---------------------------------------------------------------------------


def insert_artifact(conn: Connection, values: dict[str, Any]) -> None:
    conn.execute(_artifacts.insert().values(values))


def upsert_artifact(conn: Connection, values: dict[str, Any]) -> None:
    """Insert a row, or replace the one with the same (session, kind, local id): a row a
    fork inherited, written anew, is the fork's own."""
    values = {**values, "inherited": False}
    ins = _insert(conn)(_artifacts).values(values)
    keys = ("session_id", "kind", "local_id")
    changed = {k: ins.excluded[k] for k in values if k not in keys}
    conn.execute(
        ins.on_conflict_do_update(index_elements=[_artifacts.c[k] for k in keys], set_=changed)
    )


def set_size(
    conn: Connection,
    session_id: str,
    kind: str,
    local_id: str,
    size: int,
    *,
    sha256: str,
    sidecar_sha256: str | None = None,
) -> None:
    """The size and SHA-256 of an artifact's rewritten bytes (and of its sidecar's): a row
    a fork inherited, written anew, is the fork's own."""
    conn.execute(
        update(_artifacts)
        .where(_key(session_id, kind, local_id))
        .values(size_bytes=size, sha256=sha256, sidecar_sha256=sidecar_sha256, inherited=False)
    )


def finish_tool_output(
    conn: Connection, session_id: str, local_id: str, size: int, sha256: str | None = None
) -> bool:
    """A streamed tool output is whole: its size, SHA-256 (None: not known) and
    ``complete`` in one statement (also over ``truncated``: a writer expiry took for dead
    that finished after all). Whether the row is there."""
    result = conn.execute(
        update(_artifacts)
        .where(_key(session_id, TOOL_OUTPUT, local_id))
        .values(size_bytes=size, sha256=sha256, state=COMPLETE)
    )
    return bool(result.rowcount)


def truncate_stale(conn: Connection, session_id: str, local_id: str, size: int) -> bool:
    """Mark a tool output whose writer died ``truncated`` with the bytes it left; only while
    it is still ``writing`` (a finalize that committed meanwhile wins). Whether it was."""
    result = conn.execute(
        update(_artifacts)
        .where(_key(session_id, TOOL_OUTPUT, local_id), _artifacts.c.state == WRITING)
        .values(size_bytes=size, state=TRUNCATED)
    )
    return bool(result.rowcount)


def stale_writes(
    conn: Connection, cutoff: datetime, limit: int, *, after: tuple[str, str] = ("", "")
) -> list[tuple[str, str, str, str | None]]:
    """(session id, tenant id, artifact id, file name) of tool outputs still ``writing``
    that were allocated before ``cutoff``, by (session id, artifact id) after ``after``."""
    key = (_artifacts.c.session_id, _artifacts.c.local_id)
    rows = conn.execute(
        select(_artifacts.c.session_id, _sessions.c.tenant_id, *key[1:], _artifacts.c.name)
        .select_from(_artifacts.join(_sessions, _sessions.c.id == _artifacts.c.session_id))
        .where(
            _artifacts.c.state == WRITING,
            _artifacts.c.created_at < cutoff,
            _artifacts.c.kind == TOOL_OUTPUT,
            tuple_(*key) > tuple_(*after),
        )
        .order_by(*key)
        .limit(limit)
    )
    return [(r.session_id, r.tenant_id, r.local_id, r.name) for r in rows]


def _key(session_id: str, kind: str, local_id: str) -> Any:
    return and_(
        _artifacts.c.session_id == session_id,
        _artifacts.c.kind == kind,
        _artifacts.c.local_id == local_id,
    )


def get_artifact(
    conn: Connection, session_id: str, kind: str, local_id: str
) -> ArtifactInfo | None:
    row = conn.execute(select(_artifacts).where(_key(session_id, kind, local_id))).first()
    return _to_info(row) if row is not None else None


def has_expired(
    conn: Connection, row: ArtifactInfo, *, now: Callable[[], datetime] | None = None
) -> bool:
    """The row has a TTL and it is past, by the database's clock (the one that wrote it);
    ``now``, if given, reads that clock instead (a caller judging many rows reads it once)."""
    if row.expires_at is None:
        return False
    return row.expires_at <= (database_now(conn) if now is None else now())


def inherited_keys(conn: Connection, session_id: str) -> set[tuple[str, str]]:
    """(kind, local id) of the rows a fork copied from its parent at its creation and has
    not written anew since."""
    rows = conn.execute(
        select(_artifacts.c.kind, _artifacts.c.local_id).where(
            _artifacts.c.session_id == session_id, _artifacts.c.inherited
        )
    )
    return {(r.kind, r.local_id) for r in rows}


def list_artifacts(
    conn: Connection, session_id: str, kind: str | None = None, *, prefix: str | None = None
) -> list[ArtifactInfo]:
    query = select(_artifacts).where(_artifacts.c.session_id == session_id)
    if kind is not None:
        query = query.where(_artifacts.c.kind == kind)
    if prefix is not None:
        query = query.where(
            (_artifacts.c.local_id == prefix)
            | _artifacts.c.local_id.startswith(prefix + "/", autoescape=True)
        )
    rows = conn.execute(query.order_by(_artifacts.c.kind, _artifacts.c.id))
    return [_to_info(r) for r in rows]


def local_ids(conn: Connection, session_id: str, kind: str) -> list[str]:
    rows = conn.execute(
        select(_artifacts.c.local_id)
        .where(_artifacts.c.session_id == session_id, _artifacts.c.kind == kind)
        .order_by(_artifacts.c.id)
    )
    return [str(r) for r in rows.scalars()]


def delete_artifact(conn: Connection, session_id: str, kind: str, local_id: str) -> bool:
    result = conn.execute(delete(_artifacts).where(_key(session_id, kind, local_id)))
    return bool(result.rowcount)


# --- path-addressed files: usage and conflicts ------------------------------------------------


def session_file_usage(conn: Connection, session_id: str) -> int:
    value = conn.execute(
        select(func.coalesce(func.sum(_artifacts.c.size_bytes), 0)).where(
            _artifacts.c.session_id == session_id, _artifacts.c.kind == FILE
        )
    ).scalar_one()
    return int(value)


def tenant_file_usage(conn: Connection, tenant_id: str) -> int:
    value = conn.execute(
        select(func.coalesce(func.sum(_artifacts.c.size_bytes), 0))
        .select_from(_artifacts.join(_sessions, _sessions.c.id == _artifacts.c.session_id))
        .where(_sessions.c.tenant_id == tenant_id, _artifacts.c.kind == FILE)
    ).scalar_one()
    return int(value)


def file_conflict(conn: Connection, session_id: str, path: str) -> str | None:
    """A stored file that is an ancestor or a descendant of ``path``, if any.

    ``a`` and ``a/b`` cannot both exist: one would have to be a file and a directory.
    """
    parts = path.split("/")
    ancestors = ["/".join(parts[:i]) for i in range(1, len(parts))]
    clash = (_artifacts.c.local_id.startswith(path + "/", autoescape=True)) | (
        _artifacts.c.local_id.in_(ancestors)
    )
    row = conn.execute(
        select(_artifacts.c.local_id)
        .where(_artifacts.c.session_id == session_id, _artifacts.c.kind == FILE, clash)
        .limit(1)
    ).first()
    return str(row.local_id) if row is not None else None


# --- oversized outputs ------------------------------------------------------------------------


def oversized_exists(session_id: Any, local_id: Any, *, expires_after: Any = None) -> Any:
    """EXISTS: oversized output ``local_id`` of ``session_id`` (values or columns), alive
    past ``expires_after`` when given."""
    where = [
        _artifacts.c.session_id == session_id,
        _artifacts.c.kind == OVERSIZED,
        _artifacts.c.local_id == local_id,
    ]
    if expires_after is not None:
        where.append(_artifacts.c.expires_at > expires_after)
    return select(_artifacts.c.id).where(*where).exists()


def oversized_owners(conn: Connection, local_ids: Collection[str]) -> set[tuple[str, str]]:
    """(session id, artifact id) of the oversized-output rows with these ids."""
    rows = conn.execute(
        select(_artifacts.c.session_id, _artifacts.c.local_id).where(
            _artifacts.c.kind == OVERSIZED, _artifacts.c.local_id.in_(list(local_ids))
        )
    )
    return {(r.session_id, r.local_id) for r in rows}


def expired_oversized(conn: Connection, now: datetime, limit: int) -> list[tuple[str, str, str]]:
    """(session id, tenant id, artifact id) of oversized outputs expired at ``now``."""
    rows = conn.execute(
        select(_artifacts.c.session_id, _sessions.c.tenant_id, _artifacts.c.local_id)
        .select_from(_artifacts.join(_sessions, _sessions.c.id == _artifacts.c.session_id))
        .where(_artifacts.c.kind == OVERSIZED, _artifacts.c.expires_at <= now)
        .order_by(_artifacts.c.expires_at)
        .limit(limit)
    )
    return [(r.session_id, r.tenant_id, r.local_id) for r in rows]


def stats(conn: Connection, kind: str, *, tenant_id: str | None = None) -> ArtifactStats:
    query = select(func.count(), func.coalesce(func.sum(_artifacts.c.size_bytes), 0)).where(
        _artifacts.c.kind == kind
    )
    if tenant_id is not None:
        query = query.select_from(
            _artifacts.join(_sessions, _sessions.c.id == _artifacts.c.session_id)
        ).where(_sessions.c.tenant_id == tenant_id)
    count, total = conn.execute(query).one()
    return ArtifactStats(int(count), int(total))


# --- blobs visible to a tenant ----------------------------------------------------------------


def blob_encoding_for_tenant(conn: Connection, blob_hash: str, tenant_id: str) -> str | None:
    """How a blob was encoded where the tenant's events reference it; None: not referenced.

    The manifest is authoritative (DESIGN): a blob is readable by a tenant only through a
    reference in one of that tenant's sessions.
    """
    row = conn.execute(
        select(_refs.c.encoding)
        .select_from(_refs.join(_sessions, _sessions.c.id == _refs.c.session_id))
        .where(_refs.c.hash == blob_hash, _sessions.c.tenant_id == tenant_id)
        .limit(1)
    ).first()
    return str(row.encoding) if row is not None else None
