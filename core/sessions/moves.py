"""Move a session to another tenant and/or cwd, with its artifact directory.

A move first finishes the fork copies that read from the session's directory (and its own),
then re-checks under both tenants' quota locks, which a fork also holds, so no new fork can
start reading from a directory that is about to move.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from sqlalchemy import Connection, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from core import nofollow
from core.artifacts import rows
from core.artifacts.paths import session_dir
from core.artifacts.storage import FileArtifactStorage, artifact_storage_for
from core.db import read_connection, write_transaction
from core.errors import ExternalIdTaken, InvalidEvent, MoveFailed, QuotaExceeded
from core.journal import Journal
from core.journal.validation import check_seconds
from core.models import MoveIntentRow, RehydrationRow, SessionRow, table_of, utcnow
from core.nofollow import artifact_root_of, check_path
from core.records import COPY_PENDING, Session
from core.sessions.fork_copy import ForkCopies
from core.sessions.lifecycle import REMOVE_MOVED, REMOVE_SESSION, record_removal
from core.sessions.object_moves import ObjectMove
from core.sessions.queries import SETTLE_ATTEMPTS, Unsettled, children
from core.settings import Settings
from core.translate import storage_errors

log = logging.getLogger(__name__)

_sessions = table_of(SessionRow)
_moves = table_of(MoveIntentRow)
_rehydrations = table_of(RehydrationRow)


class Moves:
    """Moves sessions between tenants and cwds."""

    def __init__(self, journal: Journal, settings: Settings) -> None:
        self.journal = journal
        self.engine = journal.engine
        self.settings = settings
        self.root = settings.resolved_artifact_root
        self.copies = ForkCopies(journal, settings)
        self.storage = artifact_storage_for(settings)

    def move(
        self, session_id: str, *, tenant_id: str | None = None, cwd: str | None = None
    ) -> Session:
        """Move a session to another tenant and/or cwd; its artifact directory moves with
        the metadata. If the directory cannot be moved, nothing changes and the error
        surfaces as it was raised. A move an earlier crash left half done is finished (or
        rolled back) first."""
        if tenant_id is not None and not 0 < len(tenant_id) <= 128:
            raise InvalidEvent("tenant_id", "must be 1..128 characters")
        self.repair(session_id=session_id)
        for _ in range(SETTLE_ATTEMPTS):
            self.copies.settle(session_id, include_self=True, action="move")
            try:
                return self._move_once(session_id, tenant_id, cwd)
            except Unsettled:
                continue
        raise MoveFailed(f"session {session_id}: fork copies kept starting; retry the move")

    def _move_once(self, session_id: str, tenant_id: str | None, cwd: str | None) -> Session:
        # Invariant 12: the intent is durable before the filesystem is touched, so a crash
        # at any later step leaves a row that ``repair`` completes or rolls back.
        source_tenant, target = self._record_intent(session_id, tenant_id, cwd)
        mover = self._mover(source_tenant, target, session_id)
        try:
            with write_transaction(self.engine) as conn:
                session = self._lock_tenants(conn, session_id, tenant_id)
                if session.copy_status == COPY_PENDING or children(conn, session_id):
                    raise Unsettled
                if session.tenant_id != source_tenant:
                    raise Unsettled  # moved by someone else since the intent: start over
                self._relocate(conn, session, target, cwd, mover)
                _forget_intent(conn, session_id)
                moved = self.journal.session_in(conn, session_id)
        except BaseException:
            if mover.undo():
                self._drop_intent(session_id)
            else:
                # The directory is neither back nor committed: only the intent still says
                # where it is, so it stays for ``repair`` (dropped, the files were stranded
                # under the other tenant with nothing naming them).
                log.error(
                    "a failed move could not be undone; its intent stays for the repair",
                    extra={"session_id": session_id, "to_tenant": target},
                )
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

    def _mover(self, source: str, target: str, session_id: str) -> _DirectoryMove | ObjectMove:
        source_dir = session_dir(self.root, source, session_id)
        target_dir = session_dir(self.root, target, session_id)
        if isinstance(self.storage, FileArtifactStorage):
            return _DirectoryMove(source_dir, target_dir)
        return ObjectMove(self.storage, self.root, source_dir, target_dir)

    def _record_intent(
        self, session_id: str, tenant_id: str | None, cwd: str | None
    ) -> tuple[str, str]:
        """Commit the move's intent row; (source tenant, target tenant)."""
        try:
            with write_transaction(self.engine) as conn:
                session = self._lock_tenants(conn, session_id, tenant_id)
                target = tenant_id or session.tenant_id
                conn.execute(
                    insert(_moves).values(
                        session_id=session_id,
                        from_tenant=session.tenant_id,
                        to_tenant=target,
                        cwd=cwd,
                        started_at=utcnow(),
                    )
                )
                # Seen by what touches the session's files outside the lock (an oversized
                # output's discard): a move happened, even one that is undone later.
                rows.raise_move_epoch(conn, session_id)
        except IntegrityError as exc:
            raise MoveFailed(f"session {session_id}: another move is in progress") from exc
        return session.tenant_id, target

    def _drop_intent(self, session_id: str) -> None:
        try:
            with write_transaction(self.engine) as conn:
                _forget_intent(conn, session_id)
        except Exception as exc:  # the row stays; repair rolls it back later
            log.error(
                "could not drop a failed move's intent",
                extra={"session_id": session_id, "error": str(exc)},
            )

    # repair ---------------------------------------------------------------------------------

    def pending(
        self, *, older_than_s: float = 0.0, limit: int = 1000, session_id: str | None = None
    ) -> list[MoveIntent]:
        """Moves whose intent row is older than ``older_than_s`` (crashed), oldest first;
        only that of ``session_id`` when given."""
        cutoff = utcnow() - timedelta(seconds=older_than_s)
        query = (
            select(_moves)
            .where(_moves.c.started_at <= cutoff)
            .order_by(_moves.c.started_at)
            .limit(limit)
        )
        if session_id is not None:
            query = query.where(_moves.c.session_id == session_id)
        with read_connection(self.engine) as conn:
            found = conn.execute(query)
            return [MoveIntent(r.session_id, r.from_tenant, r.to_tenant, r.cwd) for r in found]

    def repair(
        self, *, session_id: str | None = None, older_than_s: float = 0.0
    ) -> list[MoveRepair]:
        """Complete or roll back every move a crash left half done (or that of one session).

        The directory decides: renamed (the target exists) means the move completes;
        otherwise it rolls back. Both existing (the old one re-created after the rename: a
        tool that wrote to the path it was given, a staged write) is a rename too: what the
        old one holds is newer, and is merged into the target, never left behind (writes
        wait for the repair, ``rows.lock_for_write``; a file written to a path handed out
        before the crash does not). Runs under the tenants' quota locks, as a move does, so
        a live move's rename and commit are never split by it; the reconciler passes an
        age so that it does not roll back a live move between its intent and its rename.
        """
        check_seconds(older_than_s, "older_than_s")
        intents = self.pending(older_than_s=older_than_s, session_id=session_id)
        return [self._repair_one(intent) for intent in intents]

    def _repair_one(self, intent: MoveIntent) -> MoveRepair:
        source = session_dir(self.root, intent.from_tenant, intent.session_id)
        target = session_dir(self.root, intent.to_tenant, intent.session_id)
        with write_transaction(self.engine) as conn:
            for tenant in sorted({intent.from_tenant, intent.to_tenant}):
                rows.lock_tenant(conn, tenant)
            row = conn.execute(
                select(_sessions.c.tenant_id, _sessions.c.cwd).where(
                    _sessions.c.id == intent.session_id
                )
            ).first()
            if isinstance(self.storage, FileArtifactStorage):
                renamed = source != target and _settle_directories(source, target)
            else:
                renamed = (
                    source != target
                    and ObjectMove(self.storage, self.root, source, target).settle()
                )
            if row is None:
                outcome = "gone"
                # Deleted meanwhile: its files may be under either tenant; both go.
                for kind, tenant in (
                    (REMOVE_SESSION, intent.from_tenant),
                    (REMOVE_MOVED, intent.to_tenant),
                ):
                    if kind == REMOVE_SESSION or source != target:
                        record_removal(
                            conn, session_id=intent.session_id, kind=kind, tenant_id=tenant
                        )
            elif row.tenant_id == intent.from_tenant and (renamed or source == target):
                if intent.cwd is not None and intent.cwd != row.cwd:
                    forget_rehydrations(conn, intent.session_id)
                conn.execute(
                    update(_sessions)
                    .where(_sessions.c.id == intent.session_id)
                    .values(
                        tenant_id=intent.to_tenant,
                        cwd=row.cwd if intent.cwd is None else intent.cwd,
                        updated_at=utcnow(),
                    )
                )
                outcome = "completed"
            else:
                outcome = "rolled_back"
            _forget_intent(conn, intent.session_id)
        log.warning(
            "repaired an interrupted session move",
            extra={"session_id": intent.session_id, "outcome": outcome},
        )
        return MoveRepair(intent.session_id, intent.from_tenant, intent.to_tenant, outcome)

    def _relocate(
        self,
        conn: Connection,
        session: Session,
        tenant_id: str,
        cwd: str | None,
        mover: _DirectoryMove | ObjectMove,
    ) -> None:
        """Update the row, then rename the directory (inside the transaction: a failed
        rename raises before the commit; a failed commit is undone by the caller)."""
        if tenant_id != session.tenant_id:
            self._check_move_quota(conn, session, tenant_id)
        if cwd is not None and cwd != session.cwd:
            forget_rehydrations(conn, session.id)
        try:
            conn.execute(
                update(_sessions)
                .where(_sessions.c.id == session.id)
                .values(
                    tenant_id=tenant_id,
                    cwd=session.cwd if cwd is None else cwd,
                    updated_at=utcnow(),
                )
            )
        except IntegrityError:
            # (tenant, external id) is unique: the tenant has a session of that id already
            # (nothing moved yet; the caller rolls the transaction back)
            if session.external_id is None:
                raise
            raise ExternalIdTaken(tenant_id, session.external_id) from None
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


@dataclass(frozen=True, slots=True)
class MoveIntent:
    session_id: str
    from_tenant: str
    to_tenant: str
    cwd: str | None


@dataclass(frozen=True, slots=True)
class MoveRepair:
    session_id: str
    from_tenant: str
    to_tenant: str
    outcome: str  # completed | rolled_back | gone (the session was deleted)

    def to_dict(self) -> dict[str, str]:
        return {
            "session_id": self.session_id,
            "from_tenant": self.from_tenant,
            "to_tenant": self.to_tenant,
            "outcome": self.outcome,
        }


def forget_rehydrations(conn: Connection, session_id: str) -> None:
    """Forget the session's on-demand builds (``core.interop.rehydrated``): an export's
    header names the session's cwd, so one built before a cwd move is stale. Their outputs
    expire with their TTL; a build running now finds its claim gone and builds again."""
    conn.execute(delete(_rehydrations).where(_rehydrations.c.session_id == session_id))


def _forget_intent(conn: Connection, session_id: str) -> None:
    conn.execute(delete(_moves).where(_moves.c.session_id == session_id))


def _is_dir(path: Path) -> bool:
    return stat.S_ISDIR(os.lstat(path).st_mode) if os.path.lexists(path) else False


@storage_errors("artifacts")
def _settle_directories(source: Path, target: Path) -> bool:
    """For ``repair`` on disk: whether the directory was renamed (the move completes), with
    what the source holds beside the target merged into it first."""
    if not _is_dir(target):
        return False
    if _is_dir(source):
        moved = nofollow.merge_into(artifact_root_of(source), source, target)
        log.warning(
            "merged a re-created directory into a moved session's directory",
            extra={"source": str(source), "target": str(target), "entries": moved},
        )
    return True


class _DirectoryMove:
    """Rename a session's artifact directory; ``undo`` puts it back after a failed commit."""

    def __init__(self, source: Path, target: Path) -> None:
        self.source = source
        self.target = target
        self._moved = False

    @storage_errors("artifacts")
    def run(self) -> None:
        if self.source == self.target:
            return
        root = artifact_root_of(self.source)
        check_path(root, self.source)
        check_path(root, self.target)
        if not nofollow.exists(root, self.source):
            if nofollow.exists(root, self.target):
                # Only this session's id names it: an earlier move renamed the directory and
                # then failed to commit without undoing (a crash). Adopt it.
                log.warning(
                    "completing an interrupted session move",
                    extra={"source": str(self.source), "target": str(self.target)},
                )
            return
        if nofollow.exists(root, self.target):
            raise MoveFailed(f"the target artifact directory already exists: {self.target}")
        nofollow.rename(root, self.source, self.target)  # fsyncs both parents
        self._moved = True

    def undo(self) -> bool:
        """Whether the directory is where the session's row says (back, or never moved)."""
        if not self._moved:
            return True
        try:
            nofollow.rename(artifact_root_of(self.source), self.target, self.source)
            self._moved = False
        except Exception as exc:
            log.error(
                "could not move a session's artifact directory back after a failed move",
                extra={"source": str(self.source), "target": str(self.target), "error": str(exc)},
            )
            return False
        return True
