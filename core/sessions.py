"""Session lifecycle: fork (and the fork's artifact copy), move and delete.

Fork. One write transaction, under the tenant's quota lock and then the writers' lock:
the fork's row, the parent's events 1..at_seq with the same payloads at new positions and
their manifest rows (blobs are shared, never copied), the artifact rows the fork inherits,
counters that continue after the inherited ids, and the parent's snapshots up to the fork
point (a snapshot is a function of the first ``seq`` events only, so they hold for the fork).
The bytes of the inherited artifacts are copied afterwards by ``copy_artifacts`` (a Celery
task in the queue setup); until then (and after a failed copy, until a retry succeeds) the
fork reads them from the ancestor that holds the identical artifact row and an unmodified
file (``inherited_source``). A fork that inherits no artifact is ``copied`` at once: there
is nothing to wait for, and nothing for the reconciler to chase.

The copy never overwrites: each file is staged in the fork's directory and published with
``link`` (which fails if the name exists), then the staged name is removed, so every file
has one name afterwards and the parent's later writes never show through. Running the copy
twice, or two copies at once, is safe.

Move and delete first finish the copies that read from the session's directory (its pending
forks', and for a move its own), then re-check under the tenant's quota lock, which a fork
also holds, so no new fork can start reading from a directory that is about to go.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
import shutil
import stat
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from sqlalchemy import (
    Connection,
    Engine,
    Select,
    String,
    delete,
    func,
    insert,
    literal,
    select,
    text,
    update,
)

from core.artifacts import rows
from core.artifacts.fsio import fsync_dir
from core.artifacts.manager import TOOL_COUNTER, agent_counter
from core.artifacts.paths import STAGING_DIR, agent_output_names, contained_path, session_dir
from core.artifacts.records import AGENT_OUTPUT, FILE, TOOL_OUTPUT, ArtifactInfo
from core.artifacts.rows import _QUOTA_LOCK_PREFIX  # the one spelling of the quota lock key
from core.db import read_connection, write_transaction
from core.errors import InvalidEvent, MoveFailed, QuotaExceeded, SessionNotFound, SessionStoreError
from core.journal import Journal
from core.models import (
    ArtifactRow,
    BlobRefRow,
    CounterRow,
    DeadLetterRow,
    EventRow,
    SessionRow,
    SnapshotRow,
    table_of,
    utcnow,
)
from core.records import Session
from core.settings import Settings
from core.snapshots import delete_snapshots

log = logging.getLogger(__name__)

PENDING = "pending"
COPIED = "copied"
FAILED = "failed"

_sessions = table_of(SessionRow)
_artifacts = table_of(ArtifactRow)
_counters = table_of(CounterRow)
_snapshots = table_of(SnapshotRow)
_letters = table_of(DeadLetterRow)
_events = table_of(EventRow)
_refs = table_of(BlobRefRow)

_EVENT_PAGE = 2000
_MAX_ANCESTORS = 64  # forks of forks walked to find an inherited file
_SETTLE_ATTEMPTS = 5
_MAX_REASONS = 5
_DIGITS = re.compile(r"^[0-9]+$")
_ARTIFACT_FIELDS = [f.name for f in dataclasses.fields(ArtifactInfo)]
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK}


class ForkCopier(Protocol):
    """Hands a committed fork's artifact copy to whatever runs it (the queue)."""

    def __call__(self, fork: Session, /) -> None: ...


class InvalidForkPoint(SessionStoreError):
    """A fork point must be a seq from 0 to the session's head."""

    def __init__(self, session_id: str, at_seq: int, head_seq: int) -> None:
        self.session_id = session_id
        self.at_seq = at_seq
        self.head_seq = head_seq
        super().__init__(
            f"session {session_id}: cannot fork at seq {at_seq}; the head is {head_seq}"
        )


class ForkCopiesInProgress(SessionStoreError):
    """New forks of the session kept starting their artifact copies; retry."""


class _Unsettled(Exception):
    """A fork copy reads from the directory in question: settle it and try again."""


# --- records ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CopyReport:
    """One run of a fork's artifact copy; ``status`` is the fork's copy status afterwards
    (None if the fork is gone)."""

    fork_id: str
    status: str | None
    copied: int = 0
    bytes_copied: int = 0
    already_present: int = 0
    missing_at_source: int = 0
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class DeleteReport:
    session_id: str
    tenant_id: str
    events: int
    artifacts: int
    forks: list[str]
    directory_removed: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class _CopyItem:
    row: ArtifactInfo
    source: Path
    target: Path
    not_after: float  # the source must not be modified after this (its fork's creation)


class _Found(NamedTuple):
    """Where an inherited artifact's bytes are: ``path`` (None: nowhere), whether they are
    still the content the fork inherited, and the time the source must not be newer than."""

    path: Path | None
    inherited: bool
    not_after: float = 0.0


class _SourceChanged(OSError):
    """The parent rewrote the artifact after the fork."""


@dataclass(slots=True)
class _CopyPlan:
    fork: Session
    directory: Path
    items: list[_CopyItem] = field(default_factory=list)
    present: int = 0
    missing: int = 0
    lost: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _CopyOutcome:
    copied: int = 0
    bytes: int = 0
    present: int = 0
    errors: list[str] = field(default_factory=list)


# --- the lifecycle -----------------------------------------------------------------------------


class SessionLifecycle:
    """fork, copy_artifacts, move and delete over one journal and artifact root."""

    def __init__(self, journal: Journal, settings: Settings) -> None:
        self.journal = journal
        self.engine = journal.engine
        self.settings = settings
        self.root = settings.resolved_artifact_root

    # fork ---------------------------------------------------------------------------------

    def fork(
        self, session_id: str, *, at_seq: int | None = None, tenant_id: str | None = None
    ) -> Session:
        """A new session holding the parent's events 1..at_seq (default: the head)."""
        fork_id = str(uuid.uuid4())
        with write_transaction(self.engine) as conn:
            parent = self._lock_for_fork(conn, session_id, tenant_id)
            # After the locks: the fork's creation time bounds which parent files it
            # inherited unchanged (see ``_ancestor_file``).
            now = utcnow()
            point = _fork_point(parent, at_seq)
            inherited = _inherited_rows(conn, parent.id, point, now)
            self._check_fork_quota(conn, parent, inherited)
            _insert_fork_row(conn, parent, fork_id, point, PENDING if inherited else COPIED, now)
            self.journal.copy_events(conn, parent.id, fork_id, point, recorded_at=now)
            _insert_artifact_rows(conn, fork_id, inherited)
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

    def copy_artifacts(self, fork_id: str) -> CopyReport:
        """Copy a fork's inherited artifact files into its own directory (idempotent).

        Runs for ``pending`` and ``failed`` forks (a re-run retries a failed copy); anything
        else is reported as it is. Copy errors end as status ``failed`` with the reason.
        """
        with read_connection(self.engine) as conn:
            fork = self.journal.session_in(conn, fork_id)
            if fork.copy_status not in (PENDING, FAILED):
                return CopyReport(fork_id, fork.copy_status)
            plan = _plan_copy(conn, self.journal, self.root, fork)
        outcome = _run_copy(plan)
        return self._finish_copy(plan, outcome)

    def _finish_copy(self, plan: _CopyPlan, outcome: _CopyOutcome) -> CopyReport:
        reasons = plan.lost + outcome.errors
        status = FAILED if reasons else COPIED
        error = _summarize(reasons, len(plan.items) + len(plan.lost)) if reasons else None
        with write_transaction(self.engine) as conn:
            changed = conn.execute(
                update(_sessions)
                .where(
                    _sessions.c.id == plan.fork.id,
                    _sessions.c.copy_status.in_([PENDING, FAILED]),
                )
                .values(copy_status=status, copy_error=error)
            ).rowcount
            current = _session_or_none(conn, self.journal, plan.fork.id)
        self._drop_stale_directory(plan, current)
        report = CopyReport(
            fork_id=plan.fork.id,
            status=current.copy_status if current is not None else None,
            copied=outcome.copied,
            bytes_copied=outcome.bytes,
            already_present=plan.present + outcome.present,
            missing_at_source=plan.missing,
            error=error,
        )
        _log_copy(plan, report, changed=bool(changed))
        return report

    def _drop_stale_directory(self, plan: _CopyPlan, current: Session | None) -> None:
        """A fork deleted (or moved) while this copy ran: what we wrote is nobody's."""
        if current is not None and session_dir(self.root, current.tenant_id, current.id) == (
            plan.directory
        ):
            return
        if plan.directory.exists():
            shutil.rmtree(plan.directory, ignore_errors=True)

    def pending_forks(self, *, older_than_s: float, limit: int = 1000) -> list[str]:
        """Forks whose copy has been pending for longer than ``older_than_s``, oldest first."""
        query = pending_forks_query(utcnow() - timedelta(seconds=older_than_s), limit)
        with read_connection(self.engine) as conn:
            return [str(v) for v in conn.execute(query).scalars()]

    def _settle(self, session_id: str, *, include_self: bool) -> None:
        """Finish the copies that read from this session's directory (and, for a move, its
        own: a copy running during the rename would write into the old directory)."""
        with read_connection(self.engine) as conn:
            fork_ids = _children(conn, session_id, statuses=(PENDING, FAILED))
            own = self.journal.session_in(conn, session_id).copy_status
        if include_self and own == PENDING:
            fork_ids.append(session_id)
        for fork_id in fork_ids:
            try:
                self.copy_artifacts(fork_id)
            except SessionNotFound:
                continue

    # move -----------------------------------------------------------------------------------

    def move(
        self, session_id: str, *, tenant_id: str | None = None, cwd: str | None = None
    ) -> Session:
        """Move a session to another tenant and/or cwd; its artifact directory moves with
        the metadata. If the directory cannot be moved, nothing changes and the error
        surfaces as it was raised."""
        if tenant_id is not None and not 0 < len(tenant_id) <= 128:
            raise InvalidEvent("tenant_id", "must be 1..128 characters")
        for _ in range(_SETTLE_ATTEMPTS):
            self._settle(session_id, include_self=True)
            try:
                return self._move_once(session_id, tenant_id, cwd)
            except _Unsettled:
                continue
        raise MoveFailed(f"session {session_id}: fork copies kept starting; retry the move")

    def _move_once(self, session_id: str, tenant_id: str | None, cwd: str | None) -> Session:
        mover: _DirectoryMove | None = None
        try:
            with write_transaction(self.engine) as conn:
                session = self._lock_tenants(conn, session_id, tenant_id)
                if session.copy_status == PENDING or _children(conn, session_id):
                    raise _Unsettled
                target = tenant_id or session.tenant_id
                mover = _DirectoryMove(
                    session_dir(self.root, session.tenant_id, session_id),
                    session_dir(self.root, target, session_id),
                )
                self._relocate(conn, session, target, cwd, mover)
                moved = self.journal.session_in(conn, session_id)
        except BaseException:
            if mover is not None:
                mover.undo()
            raise
        log.info(
            "session moved",
            extra={
                "session_id": session_id,
                "from_tenant": session.tenant_id,
                "to_tenant": moved.tenant_id,
                "cwd": moved.cwd,
            },
        )
        return moved

    def _relocate(
        self,
        conn: Connection,
        session: Session,
        tenant_id: str,
        cwd: str | None,
        mover: _DirectoryMove,
    ) -> None:
        """Update the row, then rename the directory (inside the transaction: a failed
        rename raises before the commit; a failed commit is undone by the caller)."""
        if tenant_id != session.tenant_id:
            self._check_move_quota(conn, session, tenant_id)
        conn.execute(
            update(_sessions)
            .where(_sessions.c.id == session.id)
            .values(
                tenant_id=tenant_id,
                cwd=session.cwd if cwd is None else cwd,
                updated_at=utcnow(),
            )
        )
        mover.run()

    def _lock_tenants(self, conn: Connection, session_id: str, new_tenant: str | None) -> Session:
        """Hold the quota locks of both tenants (in name order, so two moves in opposite
        directions cannot deadlock), then re-read the session in case it moved meanwhile."""
        session = self.journal.session_in(conn, session_id)
        while True:
            for tenant in sorted({session.tenant_id, new_tenant or session.tenant_id}):
                _lock_tenant_quota(conn, tenant)
            current = self.journal.session_in(conn, session_id)
            if current.tenant_id == session.tenant_id:
                return current
            session = current

    def _check_move_quota(self, conn: Connection, session: Session, tenant_id: str) -> None:
        size = rows.session_file_usage(conn, session.id)
        if not size:
            return
        used = rows.tenant_file_usage(conn, tenant_id)
        limit = self.settings.quota_tenant_bytes
        if used + size > limit:
            raise QuotaExceeded("tenant", limit=limit, used=used, requested=size)

    # delete ---------------------------------------------------------------------------------

    def delete(self, session_id: str, *, tenant_id: str | None = None) -> DeleteReport:
        """Remove a session with its events, manifest rows, idempotency records, snapshots,
        artifact rows, counters and dead letters, then its directory. Blobs stay for GC;
        forks keep working (their events are their own, their copies are finished first)."""
        self.journal.get_session(session_id, tenant_id=tenant_id)
        for _ in range(_SETTLE_ATTEMPTS):
            self._settle(session_id, include_self=False)
            try:
                report = self._delete_once(session_id, tenant_id)
            except _Unsettled:
                continue
            return self._remove_directory(report)
        raise ForkCopiesInProgress(
            f"session {session_id}: fork copies kept starting; retry the delete"
        )

    def _delete_once(self, session_id: str, tenant_id: str | None) -> DeleteReport:
        with write_transaction(self.engine) as conn:
            rows.lock_quota(conn, session_id)
            session = self.journal.session_in(conn, session_id, tenant_id=tenant_id)
            if _children(conn, session_id):
                raise _Unsettled
            artifacts = conn.execute(
                select(func.count()).where(_artifacts.c.session_id == session_id)
            ).scalar_one()
            forks = _children(conn, session_id, statuses=None)
            self.journal.delete_events_of(conn, session_id)
            delete_snapshots(conn, session_id)
            for table in (_artifacts, _counters, _letters, _sessions):
                column = table.c.id if table is _sessions else table.c.session_id
                conn.execute(delete(table).where(column == session_id))
        return DeleteReport(
            session_id, session.tenant_id, session.head_seq, int(artifacts), forks, False
        )

    def _remove_directory(self, report: DeleteReport) -> DeleteReport:
        # After the commit: a crash here leaves an orphan directory no session names, never
        # a session without its files.
        directory = session_dir(self.root, report.tenant_id, report.session_id)
        removed = True
        try:
            shutil.rmtree(directory)
        except FileNotFoundError:
            pass
        except OSError as exc:
            removed = False
            log.warning(
                "session deleted; its artifact directory could not be removed",
                extra={"session_id": report.session_id, "path": str(directory), "error": str(exc)},
            )
        log.info(
            "session deleted",
            extra={
                "session_id": report.session_id,
                "tenant_id": report.tenant_id,
                "events": report.events,
                "artifacts": report.artifacts,
                "forks": len(report.forks),
            },
        )
        return replace(report, directory_removed=removed)


# --- reading a pending fork's inherited artifacts ----------------------------------------------


def copy_unfinished(engine: Engine, session_id: str) -> bool:
    """Whether the session is a fork whose artifact copy is pending or failed."""
    with read_connection(engine) as conn:
        status = conn.execute(
            select(_sessions.c.copy_status).where(_sessions.c.id == session_id)
        ).scalar()
    return status in (PENDING, FAILED)


def pending_forks_query(cutoff: datetime, limit: int) -> Select[tuple[str]]:
    """Forks with a pending copy created before ``cutoff``, oldest first (indexed by
    ``ix_sessions_copy_status_created``)."""
    return (
        select(_sessions.c.id)
        .where(_sessions.c.copy_status == PENDING, _sessions.c.created_at <= cutoff)
        .order_by(_sessions.c.created_at)
        .limit(limit)
    )


def read_artifact_file(engine: Engine, root: Path, own: Path, row: ArtifactInfo) -> bytes | None:
    """The bytes of ``row``'s file at ``own`` (the session's own copy); for a fork whose
    artifact copy is unfinished, what it inherited instead. None: neither is there.

    The own file wins, and is read again when the fallback comes up empty: the copy may
    have completed in between (files are copied before the status changes).
    """
    data = _read_bytes(own)
    if data is not None:
        return data
    with read_connection(engine) as conn:
        source = inherited_source(conn, root, row.session_id, row)
    data = _read_bytes(source) if source is not None else None
    return data if data is not None else _read_bytes(own)


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def inherited_source(
    conn: Connection, root: Path, session_id: str, row: ArtifactInfo
) -> Path | None:
    """Where a fork reads an inherited artifact from until its copy completes (pending, or
    failed and not yet retried: the fork stays as usable as its ancestors allow).

    Only an ancestor that still holds the identical row (same name, size, creation) and a
    file not modified since the fork is used, so a parent that rewrote or removed the
    artifact after the fork never shows through. None: not an unfinished fork, not
    inherited, or no longer available.
    """
    journal = Journal(conn.engine)
    session = _session_or_none(conn, journal, session_id)
    if session is None or session.copy_status not in (PENDING, FAILED):
        return None
    return _ancestor_file(conn, journal, root, session, row).path


def _ancestor_file(
    conn: Connection, journal: Journal, root: Path, session: Session, row: ArtifactInfo
) -> _Found:
    """The file holding the content ``session`` inherited for one of its rows.

    The ancestor must hold the identical row, and its file must not be newer than the fork
    that inherited it (a same-size rewrite keeps the row). Walks up through ancestors whose
    own copy is unfinished: a fork of a pending fork reads from the grandparent. Copies keep
    the source's modification time, so a finished copy passes the same test.
    """
    current = session
    for _ in range(_MAX_ANCESTORS):
        parent = _session_or_none(conn, journal, current.parent_id) if current.parent_id else None
        if parent is None:
            return _Found(None, False)
        held = rows.get_artifact(conn, parent.id, row.kind, row.local_id)
        if held is None or replace(held, session_id=row.session_id) != row or not held.name:
            return _Found(None, False)
        path = session_dir(root, parent.tenant_id, parent.id) / held.name
        modified, forked_at = _modified_at(path), current.created_at.timestamp()
        if modified is not None:
            return _Found(path, True, forked_at) if modified <= forked_at else _Found(None, False)
        if parent.copy_status not in (PENDING, FAILED):
            break
        current = parent
    return _Found(None, True)


def _modified_at(path: Path) -> float | None:
    """The file's modification time (POSIX seconds); None if there is no such file."""
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_mtime if stat.S_ISREG(st.st_mode) else None


# --- fork helpers ------------------------------------------------------------------------------


def _fork_point(parent: Session, at_seq: int | None) -> int:
    point = parent.head_seq if at_seq is None else at_seq
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


def _insert_artifact_rows(conn: Connection, fork_id: str, inherited: list[ArtifactInfo]) -> None:
    if inherited:
        conn.execute(
            insert(_artifacts),
            [{**_row_values(a), "session_id": fork_id} for a in inherited],
        )


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


# --- copy helpers ------------------------------------------------------------------------------


def _plan_copy(conn: Connection, journal: Journal, root: Path, fork: Session) -> _CopyPlan:
    plan = _CopyPlan(fork, session_dir(root, fork.tenant_id, fork.id))
    for row in rows.list_artifacts(conn, fork.id):
        if not row.name:
            continue
        target = contained_path(plan.directory, row.name)
        if target.exists():
            plan.present += 1
            continue
        found = _ancestor_file(conn, journal, root, fork, row)
        if found.path is not None:
            plan.items.append(_CopyItem(row, found.path, target, found.not_after))
        elif found.inherited:
            plan.missing += 1  # the ancestor has no file either (none was ever written)
        elif _was_inherited(row, fork):
            plan.lost.append(f"{row.kind} {row.local_id}: changed or removed in the parent")
    return plan


def _was_inherited(row: ArtifactInfo, fork: Session) -> bool:
    """A row the fork got at its creation (not one it allocated since), still unexpired."""
    point = fork.forked_from_seq or 0
    expired = row.expires_at is not None and row.expires_at <= utcnow()
    return row.created_seq <= point and row.created_at <= fork.created_at and not expired


def _run_copy(plan: _CopyPlan) -> _CopyOutcome:
    outcome = _CopyOutcome()
    staging = plan.directory / STAGING_DIR
    for item in plan.items:
        where = f"{item.row.kind} {item.row.local_id}"
        try:
            size = _copy_item(item, staging)
        except _SourceChanged:
            outcome.errors.append(f"{where}: changed in the parent after the fork")
        except FileNotFoundError as exc:
            if item.target.exists():
                outcome.present += 1
            else:
                outcome.errors.append(f"{where}: vanished during the copy ({exc.filename})")
        except OSError as exc:
            outcome.errors.append(f"{where}: {exc}")
        else:
            if size is None:
                outcome.present += 1
            else:
                outcome.copied += 1
                outcome.bytes += size
    return outcome


def _copy_item(item: _CopyItem, staging: Path) -> int | None:
    """Copy one artifact (an agent output's JSONL sidecar first: the markdown file marks it
    complete); bytes copied, or None if the fork already had it."""
    extra = 0
    if item.row.kind == AGENT_OUTPUT:
        sidecar = agent_output_names(item.row.local_id)[1]
        source = item.source.with_name(sidecar)
        if source.is_file():
            target = item.target.with_name(sidecar)
            extra = _copy_file(source, target, staging, item.not_after) or 0
    size = _copy_file(item.source, item.target, staging, item.not_after)
    return None if size is None else size + extra


def _copy_file(source: Path, target: Path, staging: Path, not_after: float) -> int | None:
    """An independent, fsynced copy at ``target`` unless a file is there already.

    Content and modification time come from one open file: the parent replaces files by
    rename, so the inode we read is the one we checked.
    """
    if target.exists():
        return None
    staging.mkdir(parents=True, exist_ok=True)
    tmp = staging / f"{uuid.uuid4().hex}.copy"
    try:
        with open(source, "rb") as src:
            times = os.fstat(src.fileno())
            if times.st_mtime > not_after:
                raise _SourceChanged(str(source))
            with open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
                dst.flush()
                os.fsync(dst.fileno())
        # The source's times: "not modified since the fork" must hold for the copy too.
        os.utime(tmp, ns=(times.st_atime_ns, times.st_mtime_ns))
        target.parent.mkdir(parents=True, exist_ok=True)
        if not _publish_new(tmp, target):
            return None
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(target.parent)
    return times.st_size


def _publish_new(tmp: Path, target: Path) -> bool:
    """Give the staged copy its name unless the name exists (never overwrite)."""
    try:
        os.link(tmp, target)  # the staged name is removed right after: one name per file
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        if target.exists():  # a filesystem without hard links: check, then rename
            return False
        os.replace(tmp, target)
    return True


def _summarize(reasons: list[str], total: int) -> str:
    shown = "; ".join(reasons[:_MAX_REASONS])
    more = f"; and {len(reasons) - _MAX_REASONS} more" if len(reasons) > _MAX_REASONS else ""
    return f"{len(reasons)} of {total} inherited artifacts were not copied: {shown}{more}"


def _log_copy(plan: _CopyPlan, report: CopyReport, *, changed: bool) -> None:
    extra = {
        "fork_id": report.fork_id,
        "parent_id": plan.fork.parent_id,
        "status": report.status,
        "copied": report.copied,
        "bytes": report.bytes_copied,
        "already_present": report.already_present,
        "missing_at_source": report.missing_at_source,
    }
    if report.error and changed:
        log.warning("fork artifact copy failed: %s", report.error, extra=extra)
    else:
        log.info("fork artifact copy finished", extra=extra)


# --- move helpers ------------------------------------------------------------------------------


class _DirectoryMove:
    """Rename a session's artifact directory; ``undo`` puts it back after a failed commit."""

    def __init__(self, source: Path, target: Path) -> None:
        self.source = source
        self.target = target
        self._moved = False

    def run(self) -> None:
        if self.source == self.target:
            return
        if not self.source.exists():
            if self.target.exists():
                # Only this session's id names it: an earlier move renamed the directory and
                # then failed to commit without undoing (a crash). Adopt it.
                log.warning(
                    "completing an interrupted session move",
                    extra={"source": str(self.source), "target": str(self.target)},
                )
            return
        if self.target.exists():
            raise MoveFailed(f"the target artifact directory already exists: {self.target}")
        self.target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.source, self.target)
        self._moved = True
        fsync_dir(self.source.parent)
        fsync_dir(self.target.parent)

    def undo(self) -> None:
        if not self._moved:
            return
        try:
            os.rename(self.target, self.source)
            self._moved = False
        except OSError as exc:
            log.error(
                "could not move a session's artifact directory back after a failed move",
                extra={"source": str(self.source), "target": str(self.target), "error": str(exc)},
            )


def _lock_tenant_quota(conn: Connection, tenant_id: str) -> None:
    # SQLite: the write transaction already holds the database write lock.
    if conn.dialect.name == "postgresql":
        conn.execute(
            text("SELECT pg_advisory_xact_lock(hashtext(:key))"),
            {"key": _QUOTA_LOCK_PREFIX + tenant_id},
        )


# --- shared queries ----------------------------------------------------------------------------


def _session_or_none(conn: Connection, journal: Journal, session_id: str) -> Session | None:
    try:
        return journal.session_in(conn, session_id)
    except SessionNotFound:
        return None


def _children(
    conn: Connection, session_id: str, *, statuses: tuple[str, ...] | None = (PENDING,)
) -> list[str]:
    """Forks of this session (by default those whose copy is pending)."""
    query = select(_sessions.c.id).where(_sessions.c.parent_id == session_id)
    if statuses is not None:
        query = query.where(_sessions.c.copy_status.in_(statuses))
    return [str(v) for v in conn.execute(query.order_by(_sessions.c.created_at)).scalars()]
