"""Delete a session: its events, manifest rows, idempotency records, snapshots, artifact
rows, counters and dead letters in one transaction, then its directory.

A delete first finishes the fork copies that read from the session's directory, then
re-checks under the tenant's quota lock, which a fork also holds. (Sessions are created by
the journal, which owns their rows.)
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, select

from core import nofollow
from core.artifacts import rows
from core.artifacts.inherited import held_dir
from core.artifacts.paths import session_dir
from core.artifacts.storage import FileArtifactStorage, artifact_storage_for, key_prefix_of
from core.db import write_transaction
from core.errors import ForkCopiesInProgress, StorageUnavailable, SymlinkRefused
from core.journal import Journal
from core.models import (
    ArtifactRow,
    CounterRow,
    DeadLetterRow,
    RehydrationRow,
    SessionRow,
    table_of,
)
from core.query.snapshots import delete_snapshots
from core.sessions.fork_copy import ForkCopies
from core.sessions.queries import SETTLE_ATTEMPTS, Unsettled, children, session_or_none
from core.settings import Settings

log = logging.getLogger(__name__)

_sessions = table_of(SessionRow)
_artifacts = table_of(ArtifactRow)
_counters = table_of(CounterRow)
_letters = table_of(DeadLetterRow)
_rehydrations = table_of(RehydrationRow)


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
                report, held = self._delete_once(session_id, tenant_id)
            except Unsettled:
                continue
            if held is not None:  # what its parent held for its unfinished copy
                self._remove_tree(held, "files held for a deleted fork")
            return self._remove_directory(report)
        raise ForkCopiesInProgress(
            f"session {session_id}: fork copies kept starting; retry the delete"
        )

    def _delete_once(
        self, session_id: str, tenant_id: str | None
    ) -> tuple[DeleteReport, Path | None]:
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
            self.journal.delete_events_of(conn, session_id)
            delete_snapshots(conn, session_id)
            for table in (_artifacts, _counters, _letters, _rehydrations, _sessions):
                column = table.c.id if table is _sessions else table.c.session_id
                conn.execute(delete(table).where(column == session_id))
        report = DeleteReport(
            session_id, session.tenant_id, session.head_seq, int(artifacts), forks, False
        )
        if parent is None or not isinstance(self.storage, FileArtifactStorage):
            return report, None
        return report, held_dir(session_dir(self.root, parent.tenant_id, parent.id), session_id)

    def _remove_tree(self, directory: Path, what: str) -> bool:
        """Remove ``directory`` (its objects on S3) after the rows are gone: a failure is
        logged and reported, never raised (the delete itself is done)."""
        try:
            if isinstance(self.storage, FileArtifactStorage):
                nofollow.rmtree(self.root, directory)  # follows no link, above or inside
            else:
                self.storage.delete_prefix(key_prefix_of(self.root, directory))
        except (OSError, SymlinkRefused, StorageUnavailable) as exc:
            log.warning(
                f"{what} could not be removed", extra={"path": str(directory), "error": str(exc)}
            )
            return False
        return True

    def _remove_directory(self, report: DeleteReport) -> DeleteReport:
        # After the commit: a crash here leaves an orphan directory no session names, never
        # a session without its files.
        directory = session_dir(self.root, report.tenant_id, report.session_id)
        removed = self._remove_tree(directory, "the deleted session's artifact directory")
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
