"""Delete a session: its events, manifest rows, idempotency records, snapshots, artifact
rows, counters and dead letters in one transaction, then its directory.

The transaction also records the directory (``session_removals``); the record goes once the
directory is removed. A directory a crash, a failing disk or S3 left behind is therefore
still named, and ``finish_removals`` (every expiry run) removes it.

A delete first finishes the fork copies that read from the session's directory, then
re-checks under the tenant's quota lock, which a fork also holds. (Sessions are created by
the journal, which owns their rows.)
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, delete, func, insert, select, tuple_
from sqlalchemy.exc import SQLAlchemyError

from core.artifacts import rows
from core.artifacts.inherited import held_dir
from core.artifacts.paths import session_dir
from core.artifacts.storage import FileArtifactStorage, artifact_storage_for, key_prefix_of
from core.db import read_connection, write_transaction
from core.errors import ForkCopiesInProgress, StorageUnavailable, SymlinkRefused
from core.journal import Journal
from core.models import (
    ArtifactRow,
    CounterRow,
    DeadLetterRow,
    MoveIntentRow,
    RehydrationRow,
    SessionRemovalRow,
    SessionRow,
    database_clock,
    table_of,
)
from core.query.snapshots import delete_snapshots
from core.records import Session
from core.sessions.fork_copy import ForkCopies
from core.sessions.queries import SETTLE_ATTEMPTS, Unsettled, children, session_or_none
from core.settings import Settings

log = logging.getLogger(__name__)

_sessions = table_of(SessionRow)
_artifacts = table_of(ArtifactRow)
_counters = table_of(CounterRow)
_letters = table_of(DeadLetterRow)
_rehydrations = table_of(RehydrationRow)
_removals = table_of(SessionRemovalRow)
_moves = table_of(MoveIntentRow)

REMOVE_SESSION = "session"  # the session's own directory
REMOVE_MOVED = "moved"  # its copy under the other tenant of a move a crash interrupted
REMOVE_HELD = "held"  # what its parent held for it as an unfinished fork
# A record is left to its own delete this long (that delete removes the directory right
# after its commit); an older one was left behind.
REMOVAL_SETTLED = timedelta(minutes=5)
# An expiry run stops after this many directories it could not remove (each is reported;
# the pages after it are still read, so those never hold up the others).
REMOVAL_MAX_FAILED = 1000
# What ``_remove_held`` and ``_finish`` say of a directory whose place a move settles first.
_DEFERRED = "deferred: a move settles where it is"


def _in_move(conn: Connection, session_id: str) -> bool:
    """Whether a move of the session is under way (or was interrupted)."""
    found = conn.execute(select(_moves.c.session_id).where(_moves.c.session_id == session_id))
    return found.first() is not None


def record_removal(
    conn: Connection, *, session_id: str, kind: str, tenant_id: str, parent_id: str | None = None
) -> None:
    """Name a directory of a deleted session for removal, in the caller's transaction
    (nothing when it is named already). The time is the database's, as the expiry run
    judges it: a host whose clock is behind never makes a record look settled at once."""
    named = conn.execute(
        select(_removals.c.session_id).where(
            (_removals.c.session_id == session_id) & (_removals.c.kind == kind)
        )
    ).first()
    if named is None:
        conn.execute(
            insert(_removals).values(
                session_id=session_id,
                kind=kind,
                tenant_id=tenant_id,
                parent_id=parent_id,
                deleted_at=database_clock(conn.engine),
            )
        )


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


@dataclass(slots=True)
class RemovalReport:
    """Directories of deleted sessions left behind: ``pending`` found (settled), ``removed``
    (with ``apply``), ``deferred`` (a move of the session, or of the parent that holds them,
    interrupted or under way: where they are is settled by then), ``errors`` for those that
    could not be removed. The deferred and the failed are retried by the next run."""

    pending: int = 0
    removed: int = 0
    deferred: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


class SessionLifecycle:
    """Deletes sessions (with everything that is theirs)."""

    def __init__(self, journal: Journal, settings: Settings) -> None:
        self.journal = journal
        self.engine = journal.engine
        self.settings = settings
        self.root = settings.resolved_artifact_root
        self.copies = ForkCopies(journal, settings)
        self.storage = artifact_storage_for(settings)

    def delete(self, session_id: str, *, tenant_id: str | None = None) -> DeleteReport:
        """Remove a session with its events, manifest rows, idempotency records, snapshots,
        artifact rows, counters, dead letters and rehydrated-export records, then its
        directory. Blobs stay for GC;
        forks keep working (their events are their own, their copies are finished first)."""
        self.journal.get_session(session_id, tenant_id=tenant_id)
        for _ in range(SETTLE_ATTEMPTS):
            self.copies.settle(session_id, include_self=False, action="delete")
            try:
                report, held, moving = self._delete_once(session_id, tenant_id)
            except Unsettled:
                continue
            if held is not None:  # what its parent held for its unfinished copy
                self._remove_held(session_id, *held)
            if moving:
                # Its files may be under either tenant (renamed, not committed): the record
                # stays, the move's repair names the other tenant's directory too, and the
                # expiry run removes both once it settled. Not removed, so not reported so.
                log.warning(
                    "a deleted session's directory waits for its move's repair",
                    extra={"session_id": session_id, "tenant_id": report.tenant_id},
                )
                return report
            return self._remove_directory(report)
        raise ForkCopiesInProgress(
            f"session {session_id}: fork copies kept starting; retry the delete"
        )

    def _delete_once(
        self, session_id: str, tenant_id: str | None
    ) -> tuple[DeleteReport, tuple[str, str] | None, bool]:
        """(the report, the parent's id and tenant when it holds files for this fork,
        whether a move of the session is pending)."""
        with write_transaction(self.engine) as conn:
            rows.lock_quota(conn, session_id)
            session = self.journal.session_in(conn, session_id, tenant_id=tenant_id)
            parent = (
                session_or_none(conn, self.journal, session.parent_id)
                if session.parent_id
                else None
            )
            if children(conn, session_id):
                raise Unsettled
            artifacts = conn.execute(
                select(func.count()).where(_artifacts.c.session_id == session_id)
            ).scalar_one()
            forks = children(conn, session_id, statuses=None)
            moving = _in_move(conn, session_id)
            # a parent holds files for an unfinished fork on the file store only (beside
            # itself, when a link stood in the fork's path); on object storage it copies
            # them into the fork's own prefix (inherited.preserve_for_forks)
            holder = parent if isinstance(self.storage, FileArtifactStorage) else None
            self._record(conn, session, holder)
            self.journal.delete_events_of(conn, session_id)
            delete_snapshots(conn, session_id)
            for table in (_artifacts, _counters, _letters, _rehydrations, _sessions):
                column = table.c.id if table is _sessions else table.c.session_id
                conn.execute(delete(table).where(column == session_id))
        report = DeleteReport(
            session_id, session.tenant_id, session.head_seq, int(artifacts), forks, False
        )
        if holder is None:
            return report, None, moving
        return report, (holder.id, holder.tenant_id), moving

    @staticmethod
    def _record(conn: Connection, session: Session, holder: Session | None) -> None:
        """Name the directories this delete will remove, in its transaction: the session's,
        and what ``holder`` (its parent) holds for it."""
        kinds = [(REMOVE_SESSION, None)] + ([(REMOVE_HELD, holder.id)] if holder else [])
        for kind, parent_id in kinds:
            record_removal(
                conn,
                session_id=session.id,
                kind=kind,
                tenant_id=session.tenant_id,
                parent_id=parent_id,
            )

    def _remove_held(
        self, fork_id: str, parent_id: str, parent_tenant: str, *, strict: bool = False
    ) -> str | None:
        """Remove what the parent holds for the deleted fork: None when done (the record
        dropped), else why not. The record stays when the parent moved meanwhile (the files
        went along, and the next expiry run finds them where the parent is then)."""
        directory = held_dir(session_dir(self.root, parent_tenant, parent_id), fork_id)
        if not self._remove_tree(directory, "files held for a deleted fork", strict=strict):
            return f"cannot remove {directory} held for deleted {fork_id}"
        with read_connection(self.engine) as conn:
            parent = session_or_none(conn, self.journal, parent_id)
            moved = _in_move(conn, parent_id) or (
                parent is not None and parent.tenant_id != parent_tenant
            )
        if moved:
            return _DEFERRED
        self._forget(fork_id, REMOVE_HELD)
        return None

    def _remove_session_dir(
        self, session_id: str, kind: str, tenant_id: str, *, strict: bool = False
    ) -> bool:
        """Remove a deleted session's directory under ``tenant_id``, then its record."""
        directory = session_dir(self.root, tenant_id, session_id)
        what = "the deleted session's artifact directory"
        if not self._remove_tree(directory, what, strict=strict):
            return False
        self._forget(session_id, kind)
        return True

    def _forget(self, session_id: str, kind: str) -> None:
        """The directory is gone: drop its record. A failure is logged, never raised (the
        delete is done; the next expiry run finds nothing to remove and drops it)."""
        try:
            with write_transaction(self.engine) as conn:
                conn.execute(
                    delete(_removals).where(
                        (_removals.c.session_id == session_id) & (_removals.c.kind == kind)
                    )
                )
        except (SQLAlchemyError, StorageUnavailable) as exc:
            log.warning(
                "a removed directory's record could not be dropped",
                extra={"session_id": session_id, "kind": kind, "error": str(exc)},
            )

    def finish_removals(self, *, apply: bool, page: int = 1000) -> RemovalReport:
        """Remove the directories deletes left behind (their records older than
        ``REMOVAL_SETTLED``), a page of records at a time; a dry run only counts them. One
        whose session (or, for what a parent held, whose parent) is in an interrupted move
        waits for its repair (the reconciler's, or ``sessions repair``)."""
        settled = database_clock(self.engine, REMOVAL_SETTLED)
        key = tuple_(_removals.c.deleted_at, _removals.c.session_id, _removals.c.kind)
        report = RemovalReport()
        after: tuple[Any, str, str] | None = None
        while len(report.errors) < REMOVAL_MAX_FAILED:
            query = select(_removals).where(_removals.c.deleted_at < settled)
            if after is not None:
                query = query.where(key > tuple_(*after))
            with read_connection(self.engine) as conn:
                rows_ = conn.execute(query.order_by(*key.clauses).limit(page)).all()
            report.pending += len(rows_)
            try:
                for row in rows_ if apply else ():
                    self._finish(row.session_id, row.kind, row.tenant_id, row.parent_id, report)
            except StorageUnavailable as exc:  # S3 down: the rest waits for the next run
                report.errors.append(f"storage unavailable, run stopped: {exc}")
                break
            if len(rows_) < page:
                break
            last = rows_[-1]
            after = (last.deleted_at, last.session_id, last.kind)
        return report

    def _finish(
        self,
        session_id: str,
        kind: str,
        tenant_id: str,
        parent_id: str | None,
        report: RemovalReport,
    ) -> None:
        owner = parent_id if kind == REMOVE_HELD and parent_id is not None else session_id
        with read_connection(self.engine) as conn:
            moving = _in_move(conn, owner)
            parent = session_or_none(conn, self.journal, owner) if kind == REMOVE_HELD else None
        problem: str | None
        if moving:  # the move's repair (or its own commit) settles where they are
            problem = _DEFERRED
        elif kind != REMOVE_HELD:
            removed = self._remove_session_dir(session_id, kind, tenant_id, strict=True)
            directory = session_dir(self.root, tenant_id, session_id)
            problem = None if removed else f"cannot remove {directory} of deleted {session_id}"
        elif parent is None:  # deleted since: it took what it held with its own directory
            self._forget(session_id, kind)
            problem = None
        else:
            problem = self._remove_held(session_id, parent.id, parent.tenant_id, strict=True)
        if problem is None:
            report.removed += 1
        elif problem == _DEFERRED:
            report.deferred += 1
        else:
            report.errors.append(problem)

    def _remove_tree(self, directory: Path, what: str, *, strict: bool = False) -> bool:
        """Remove ``directory`` (its objects on S3) after the rows are gone: a failure is
        logged and reported, never raised (the delete itself is done); but with ``strict``
        the storage itself failing (``StorageUnavailable``) is raised, for a sweep to stop
        instead of waiting out the store's retries directory after directory."""
        try:  # the file store's follows no link, above or inside (nofollow.rmtree)
            self.storage.delete_prefix(key_prefix_of(self.root, directory))
        except (OSError, SymlinkRefused, StorageUnavailable) as exc:
            if strict and isinstance(exc, StorageUnavailable):
                raise
            log.warning(
                f"{what} could not be removed", extra={"path": str(directory), "error": str(exc)}
            )
            return False
        return True

    def _remove_directory(self, report: DeleteReport) -> DeleteReport:
        # After the commit: a crash here leaves a directory its record still names (the next
        # expiry run removes it), never a session without its files.
        removed = self._remove_session_dir(report.session_id, REMOVE_SESSION, report.tenant_id)
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
