"""Move a session to another tenant and/or cwd, with its artifact directory.

A move first finishes the fork copies that read from the session's directory (and its own),
then re-checks under both tenants' quota locks, which a fork also holds, so no new fork can
start reading from a directory that is about to move.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from sqlalchemy import Connection, update

from core.artifacts import rows
from core.artifacts.fsio import fsync_dir
from core.artifacts.paths import session_dir
from core.db import write_transaction
from core.errors import InvalidEvent, MoveFailed, QuotaExceeded
from core.journal import Journal
from core.models import SessionRow, table_of, utcnow
from core.records import COPY_PENDING, Session
from core.sessions.fork_copy import ForkCopies
from core.sessions.queries import SETTLE_ATTEMPTS, Unsettled, children
from core.settings import Settings

log = logging.getLogger(__name__)

_sessions = table_of(SessionRow)


class Moves:
    """Moves sessions between tenants and cwds."""

    def __init__(self, journal: Journal, settings: Settings) -> None:
        self.journal = journal
        self.engine = journal.engine
        self.settings = settings
        self.root = settings.resolved_artifact_root
        self.copies = ForkCopies(journal, settings)

    def move(
        self, session_id: str, *, tenant_id: str | None = None, cwd: str | None = None
    ) -> Session:
        """Move a session to another tenant and/or cwd; its artifact directory moves with
        the metadata. If the directory cannot be moved, nothing changes and the error
        surfaces as it was raised."""
        if tenant_id is not None and not 0 < len(tenant_id) <= 128:
            raise InvalidEvent("tenant_id", "must be 1..128 characters")
        for _ in range(SETTLE_ATTEMPTS):
            self.copies.settle(session_id, include_self=True)
            try:
                return self._move_once(session_id, tenant_id, cwd)
            except Unsettled:
                continue
        raise MoveFailed(f"session {session_id}: fork copies kept starting; retry the move")

    def _move_once(self, session_id: str, tenant_id: str | None, cwd: str | None) -> Session:
        mover: _DirectoryMove | None = None
        try:
            with write_transaction(self.engine) as conn:
                session = self._lock_tenants(conn, session_id, tenant_id)
                if session.copy_status == COPY_PENDING or children(conn, session_id):
                    raise Unsettled
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
                rows.lock_tenant(conn, tenant)
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
