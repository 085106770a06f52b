"""Fork a session at a seq: one write transaction, no file copied.

Under the tenant's quota lock and then the writers' lock: the fork's row, the parent's
events 1..at_seq with the same payloads at new positions and their manifest rows (blobs are
shared, never copied), the artifact rows the fork inherits, counters that continue after
the inherited ids, and the parent's snapshots up to the fork point (a snapshot is a function
of the first ``seq`` events only, so they hold for the fork). The artifact bytes are copied
afterwards (``core.sessions.fork_copy``); until then the fork reads them through
``core.artifacts.inherited``. A fork that inherits no artifact with content (none, or only
outputs unfinished at the fork: ``_fork_row``) is ``copied`` at once.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, String, insert, literal, select

from core.artifacts import rows
from core.artifacts.manager import TOOL_COUNTER, agent_counter
from core.artifacts.records import AGENT_OUTPUT, FILE, TOOL_OUTPUT, TRUNCATED, ArtifactInfo
from core.db import write_transaction
from core.errors import InvalidArgument, InvalidForkPoint, QuotaExceeded
from core.journal import Journal
from core.models import ArtifactRow, SessionRow, SnapshotRow, database_now, table_of, utcnow
from core.records import COPY_DONE, COPY_PENDING, Session
from core.settings import Settings

log = logging.getLogger(__name__)

_sessions = table_of(SessionRow)
_artifacts = table_of(ArtifactRow)
_snapshots = table_of(SnapshotRow)
_DIGITS = re.compile(r"^[0-9]+$")
_ARTIFACT_FIELDS = [f.name for f in dataclasses.fields(ArtifactInfo)]


class Forks:
    """Forks sessions of one journal."""

    def __init__(self, journal: Journal, settings: Settings) -> None:
        self.journal = journal
        self.engine = journal.engine
        self.settings = settings

    def fork(
        self, session_id: str, *, at_seq: int | None = None, tenant_id: str | None = None
    ) -> Session:
        """A new session holding the parent's events 1..at_seq (default: the head)."""
        fork_id = str(uuid.uuid4())
        with write_transaction(self.engine) as conn:
            parent = self._lock_for_fork(conn, session_id, tenant_id)
            now = utcnow()
            point = _fork_point(parent, at_seq)
            inherited = _inherited_rows(conn, parent.id, point, database_now(conn))
            self._check_fork_quota(conn, parent, inherited)
            artifact_rows = [_fork_row(a, fork_id) for a in inherited]
            to_copy = any(r["inherited"] for r in artifact_rows)
            _insert_fork_row(
                conn, parent, fork_id, point, COPY_PENDING if to_copy else COPY_DONE, now
            )
            self.journal.copy_events(conn, parent.id, fork_id, point, recorded_at=now)
            if artifact_rows:
                conn.execute(insert(_artifacts), artifact_rows)
            for name, next_value in _counter_floors(inherited).items():
                rows.set_counter_floor(conn, fork_id, name, next_value)
            _copy_snapshots(conn, parent.id, fork_id, point)
            fork = self.journal.session_in(conn, fork_id)
        log.info(
            "session forked",
            extra={
                "session_id": parent.id,
                "fork_id": fork_id,
                "at_seq": point,
                "artifacts": len(inherited),
                "copy_status": fork.copy_status,
            },
        )
        return fork

    def _lock_for_fork(self, conn: Connection, session_id: str, tenant_id: str | None) -> Session:
        """The tenant's quota lock orders the fork with moves, deletes and quota-bearing
        writes; the writers' lock fixes the parent's head and gives the copies positions in
        commit order (invariant 4)."""
        rows.lock_quota(conn, session_id)
        self.journal.serialize_writers(conn)
        return self.journal.session_in(conn, session_id, tenant_id=tenant_id)

    def _check_fork_quota(
        self, conn: Connection, parent: Session, inherited: list[ArtifactInfo]
    ) -> None:
        """Inherited files count against the tenant's quota from the fork's commit on."""
        size = sum(a.size_bytes for a in inherited if a.kind == FILE)
        if not size:
            return
        used = rows.tenant_file_usage(conn, parent.tenant_id)
        limit = self.settings.quota_tenant_bytes
        if used + size > limit:
            raise QuotaExceeded("tenant", limit=limit, used=used, requested=size)

    # the artifact copy ----------------------------------------------------------------------


def _fork_point(parent: Session, at_seq: int | None) -> int:
    point = parent.head_seq if at_seq is None else at_seq
    if type(point) is not int:  # a bool is no seq either
        raise InvalidArgument("at_seq", f"must be an integer seq, not {point!r}")
    if not 0 <= point <= parent.head_seq:
        raise InvalidForkPoint(parent.id, point, parent.head_seq)
    return point


def _inherited_rows(
    conn: Connection, parent_id: str, point: int, now: datetime
) -> list[ArtifactInfo]:
    """The parent's artifacts created at or before the fork point; expired ones stay."""
    return [
        a
        for a in rows.list_artifacts(conn, parent_id)
        if a.created_seq <= point and (a.expires_at is None or a.expires_at > now)
    ]


def _insert_fork_row(
    conn: Connection, parent: Session, fork_id: str, point: int, status: str, now: datetime
) -> None:
    conn.execute(
        insert(_sessions).values(
            id=fork_id,
            tenant_id=parent.tenant_id,
            parent_id=parent.id,
            forked_from_seq=point,
            title=parent.title,
            cwd=parent.cwd,
            head_seq=point,
            copy_status=status,
            copy_error=None,
            created_at=now,
            updated_at=now,
        )
    )


def _fork_row(artifact: ArtifactInfo, fork_id: str) -> dict[str, Any]:
    """The fork's row of an artifact it inherits, marked ``inherited``: its content is the
    parent's, which the fork's copy takes. What had no whole content at the fork is the
    fork's own, with nothing to copy:

    - a tool output not complete (``writing``: the parent's tool still at it, its result,
      which would name the output, after the fork point; or ``truncated``: expiry took its
      silent writer for dead, and a writer only slow finishes it after all). Its writer is
      the parent's, and its bytes grow in the parent, so the fork holds none of them: its
      row is ``truncated`` at 0 bytes, never passed off as the whole output, nor settled by
      expiry as a dead writer's. The bytes the parent saved stay the parent's;
    - an agent output allocated and not written yet: a slot the fork may write itself.

    The parent's finishing them later changes nothing the fork inherited: its copy never
    fails on them, and never takes what the parent wrote after the fork."""
    values = {**_row_values(artifact), "session_id": fork_id, "inherited": True}
    if artifact.kind == TOOL_OUTPUT and not artifact.complete:
        values.update(state=TRUNCATED, size_bytes=0, sha256=None, inherited=False)
    elif artifact.kind == AGENT_OUTPUT and artifact.sha256 is None and not artifact.size_bytes:
        values["inherited"] = False
    return values


def _row_values(artifact: ArtifactInfo) -> dict[str, Any]:
    return {name: getattr(artifact, name) for name in _ARTIFACT_FIELDS}


def _counter_floors(inherited: list[ArtifactInfo]) -> dict[str, int]:
    """Next id of each counter: one past the highest inherited id it handed out."""
    floors: dict[str, int] = {}
    for artifact in inherited:
        found = _counter_of(artifact)
        if found is not None:
            name, number = found
            floors[name] = max(floors.get(name, 0), number + 1)
    return floors


def _counter_of(artifact: ArtifactInfo) -> tuple[str, int] | None:
    """The counter that numbered an artifact id: ``7`` (tool output), ``3-name`` or
    ``3-name.0-sub`` (agent outputs, numbered per parent output)."""
    if artifact.kind == TOOL_OUTPUT and _DIGITS.match(artifact.local_id):
        return TOOL_COUNTER, int(artifact.local_id)
    if artifact.kind == AGENT_OUTPUT:
        parent, _, own = artifact.local_id.rpartition(".")
        number = own.split("-", 1)[0]
        if _DIGITS.match(number):
            return agent_counter(parent or None), int(number)
    return None


def _copy_snapshots(conn: Connection, parent_id: str, fork_id: str, point: int) -> None:
    columns = ["session_id", "version", "seq", "state", "created_at"]
    source = select(
        literal(fork_id, String),
        _snapshots.c.version,
        _snapshots.c.seq,
        _snapshots.c.state,
        _snapshots.c.created_at,
    ).where(_snapshots.c.session_id == parent_id, _snapshots.c.seq <= point)
    conn.execute(insert(_snapshots).from_select(columns, source))
