"""TTL expiry of oversized-output artifacts: the one expiry path.

The beat job, the CLI and ``SessionStore.expire_artifacts`` all expire through
``expire_artifacts``: bounded batches until nothing is due, no cap on the total.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, delete, func, select, tuple_
from sqlalchemy.exc import SQLAlchemyError

from core.artifacts import OversizedOutputs
from core.artifacts import rows as artifact_rows
from core.artifacts.fsio import sweep_staging
from core.artifacts.records import OVERSIZED
from core.artifacts.stale import finish_stale_writes, sweep_spools
from core.artifacts.storage import FileArtifactStorage
from core.db import read_connection, write_transaction
from core.errors import StorageUnavailable
from core.journal.validation import check_limit
from core.maintenance.runs import Progress
from core.metrics import metrics
from core.models import (
    REHYDRATION_DONE,
    ArtifactRow,
    RehydrationRow,
    SessionRow,
    database_clock,
    database_now,
    table_of,
)
from core.sessions.lifecycle import SessionLifecycle

log = logging.getLogger(__name__)

_artifacts = table_of(ArtifactRow)
_rehydrations = table_of(RehydrationRow)
_sessions = table_of(SessionRow)

DEFAULT_BATCH = 1000
MAX_ERRORS_KEPT = 50
# A run stops after this many outputs whose files could not be removed (each is skipped,
# and each later batch's listing reads past them).
MAX_FAILED = 1000
SAMPLE_SIZE = 20


@dataclass(slots=True)
class ExpireRunReport:
    """Oversized outputs expired at ``now``; on a dry run ``deleted`` and
    ``rehydrations_pruned`` are what would go."""

    applied: bool
    now: datetime
    expired: int = 0
    deleted: int = 0
    bytes_freed: int = 0
    sample: list[tuple[str, str]] = field(default_factory=list)  # (session_id, artifact_id)
    # records of finished rehydrated exports whose artifact is gone (removed when applied)
    rehydrations_pruned: int = 0
    # temporary files killed processes left in staging directories (removed when applied)
    stale_temp_files: int = 0
    stale_temp_bytes: int = 0
    # oversized-output files no row names (a process killed between a publish and its
    # commit), older than the staging age (removed when applied)
    unnamed_files: int = 0
    unnamed_bytes: int = 0
    # streamed tool outputs a killed writer left ``writing``, older than the staging age:
    # marked truncated (the bytes it left kept), or complete (on S3, a finalize that
    # uploaded and died before its commit), with the bytes they hold
    stale_writes_truncated: int = 0
    stale_writes_completed: int = 0
    stale_write_bytes: int = 0
    # spool files (object storage) no writer will finalize: settled, or finalized by a
    # process killed before it removed its spool, unchanged for the staging age (removed)
    stale_spools: int = 0
    # directories of deleted sessions that their delete left behind (removed when applied),
    # and those left for the next run (a move of their session or its parent under way)
    session_directories: int = 0
    session_directories_deferred: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "applied": self.applied,
            "now": self.now.isoformat(),
            "expired": self.expired,
            "deleted" if self.applied else "would_delete": self.deleted,
            "bytes_freed": self.bytes_freed,
            "rehydrations_pruned": self.rehydrations_pruned,
            "stale_temp_files": self.stale_temp_files,
            "stale_temp_bytes": self.stale_temp_bytes,
            "unnamed_files": self.unnamed_files,
            "unnamed_bytes": self.unnamed_bytes,
            "stale_writes_truncated": self.stale_writes_truncated,
            "stale_writes_completed": self.stale_writes_completed,
            "stale_write_bytes": self.stale_write_bytes,
            "stale_spools": self.stale_spools,
            "session_directories_removed"
            if self.applied
            else "session_directories_to_remove": self.session_directories,
            "session_directories_deferred": self.session_directories_deferred,
            "sample": [list(s) for s in self.sample],
            "errors": list(self.errors),
            "seconds": round(self.seconds, 3),
        }


def expire_artifacts(
    engine: Engine,
    oversized: OversizedOutputs,
    *,
    apply: bool,
    batch_size: int = DEFAULT_BATCH,
    progress: Progress | None = None,
    now: datetime | None = None,
    lifecycle: SessionLifecycle | None = None,
) -> ExpireRunReport:
    """Oversized outputs past ``expires_at``; with ``apply``, remove them, a batch at a time,
    the temporary files killed processes left in staging directories and the oversized
    outputs no row names (both older than ``staging_max_age_seconds``), settle the streamed
    tool outputs killed writers left ``writing`` as long ago (``core.artifacts.stale``;
    counted on a dry run), and (``lifecycle``)
    the directories of deleted sessions that their delete left behind.

    The moment is fixed at the start, so the set only shrinks while it runs (new outputs
    expire later) and a dry run's count is what an apply run then deletes.
    """
    check_limit(batch_size, "batch_size")
    started = time.monotonic()
    # Rows by the database's clock (the one TTLs are written by); files by this host's, the
    # one their modification times come from (a database clock ahead would take a temp file
    # a writer has open for a stale one). A given ``now`` is both.
    files_now = time.time() if now is None else now.timestamp()
    moment = database_now(engine) if now is None else now
    count, size = _expired_totals(engine, moment)
    report = ExpireRunReport(applied=apply, now=moment, expired=count, bytes_freed=size)
    report.sample = oversized.expire(now=moment, limit=SAMPLE_SIZE).expired
    if not apply:
        report.deleted = count
    else:
        _expire_batches(oversized, report, batch_size, progress)
        # What is still due at the same moment was not freed: outputs whose file could not
        # go, those a move kept busy, and those left once the run stopped early. (A session
        # deleted meanwhile counts as freed too; an error reading it keeps the estimate.)
        try:
            report.bytes_freed = max(0, size - _expired_totals(engine, moment)[1])
        except SQLAlchemyError as exc:
            log.warning("could not count what expiry freed", extra={"error": repr(exc)})
    max_age = oversized.settings.staging_max_age_seconds
    # Builds by the database's clock (their heartbeats'), not ``now``: whether a build is
    # alive is a matter of real time. Outputs by ``moment``: those an apply run has just
    # deleted, those a dry run would.
    useless = _useless_rehydrations(engine, moment, max_age)
    report.rehydrations_pruned = _prune_rehydrations(engine, useless, apply, batch_size)
    try:
        if not isinstance(oversized.storage, FileArtifactStorage):
            from core.artifacts.objects import ObjectArtifactStorage  # obstore loads lazily

            assert isinstance(oversized.storage, ObjectArtifactStorage)
            swept = oversized.storage.sweep_staging(
                older_than_s=max_age, apply=apply, now=files_now
            )
        else:
            swept = sweep_staging(oversized.root, older_than_s=max_age, apply=apply, now=files_now)
        report.stale_temp_files, report.stale_temp_bytes = swept
    except (OSError, StorageUnavailable) as exc:
        report.errors.append(f"cannot sweep staging directories: {exc}")
    try:
        unnamed = oversized.sweep_unnamed(older_than_s=max_age, apply=apply, now=files_now)
        report.unnamed_files, report.unnamed_bytes = unnamed
    except (OSError, StorageUnavailable, SQLAlchemyError) as exc:
        report.errors.append(f"cannot sweep oversized outputs no row names: {exc}")
    _settle_stale_writes(engine, oversized, report, batch_size, files_now)
    if lifecycle is not None:
        removals = lifecycle.finish_removals(apply=apply)
        report.session_directories = removals.removed if apply else removals.pending
        report.session_directories_deferred = removals.deferred
        report.errors.extend(removals.errors[:MAX_ERRORS_KEPT])
    report.seconds = time.monotonic() - started
    if apply:
        observed = metrics()
        observed.maintenance_runs.labels("expire_artifacts").inc()
        observed.maintenance_removed.labels("expire_artifacts").inc(report.deleted)
    log.info("artifact expiry finished", extra={"expire": report.to_dict()})
    return report


def _settle_stale_writes(
    engine: Engine,
    oversized: OversizedOutputs,
    report: ExpireRunReport,
    batch_size: int,
    files_now: float,
) -> None:
    # rows and files a writer stamps with its host's clock: judged by this host's, as before
    host_now = datetime.fromtimestamp(files_now, UTC)
    try:
        stale = finish_stale_writes(
            engine,
            oversized.settings,
            oversized.storage,
            now=host_now,
            apply=report.applied,
            batch_size=batch_size,
        )
    except (StorageUnavailable, SQLAlchemyError) as exc:
        report.errors.append(f"cannot settle tool outputs left writing: {exc}")
        return
    report.stale_writes_truncated = stale.truncated
    report.stale_writes_completed = stale.completed
    report.stale_write_bytes = stale.bytes
    report.errors.extend(stale.errors[:MAX_ERRORS_KEPT])
    if isinstance(oversized.storage, FileArtifactStorage):
        return  # streamed outputs are written in place: no spool
    try:
        report.stale_spools = sweep_spools(
            engine, oversized.settings, now=host_now, apply=report.applied
        )
    except (OSError, StorageUnavailable, SQLAlchemyError) as exc:
        report.errors.append(f"cannot sweep the artifact spool: {exc}")


def _expire_batches(
    oversized: OversizedOutputs,
    report: ExpireRunReport,
    batch_size: int,
    progress: Progress | None,
) -> None:
    failed: set[tuple[str, str]] = set()
    while True:
        try:
            batch = oversized.expire(now=report.now, apply=True, limit=batch_size, skip=failed)
        except StorageUnavailable as exc:
            # The disk failed (or filled), or S3 is away: every next file would fail too.
            # Stop; the rows of what was not removed stay, and the next run carries on.
            report.errors.append(f"cannot remove an expired file: {exc}")
            return
        report.deleted += batch.deleted
        for session_id, artifact_id, error in batch.failed:
            # Its row stays (files go first) and it is not listed again in this run.
            failed.add((session_id, artifact_id))
            if len(report.errors) < MAX_ERRORS_KEPT:
                report.errors.append(
                    f"cannot remove expired output {artifact_id} of session {session_id}: {error}"
                )
        if progress is not None:
            progress("artifacts", report.deleted, report.expired)
        if len(batch.expired) < batch_size or len(failed) >= MAX_FAILED:
            return


# A finished record is pruned only once it has been finished this long: a rebuild that
# finishes while the prune runs has a fresh ``heartbeat_at``, which PostgreSQL re-checks on
# the row's newest version (a subquery alone would be read in the statement's snapshot).
_PRUNE_SETTLED = timedelta(minutes=5)


def _useless_rehydrations(engine: Engine, outputs_at: datetime, max_age_s: float) -> Any:
    """Records of rehydrated exports no request can use (the next request builds afresh
    either way, and they would otherwise pile up, one per (session, format, head) ever asked
    for):

    - finished, settled for ``_PRUNE_SETTLED``, their output gone or expired at
      ``outputs_at`` (no request reuses an expired output);
    - builds whose heartbeat stopped ``max_age_s`` ago (``staging_max_age_seconds``, as
      their staged files): a killed or failed build nobody asked for again;
    - of a session that no longer exists (a request racing the session's delete).

    A build in progress heart-beats every second, so it is never one of them."""
    output = artifact_rows.oversized_exists(
        _rehydrations.c.session_id, _rehydrations.c.artifact_id, expires_after=outputs_at
    )
    session = select(_sessions.c.id).where(_sessions.c.id == _rehydrations.c.session_id).exists()
    finished = _rehydrations.c.status == REHYDRATION_DONE
    beat = _rehydrations.c.heartbeat_at
    return (
        (finished & (beat < database_clock(engine, _PRUNE_SETTLED)) & ~output)
        | (~finished & (beat < database_clock(engine, timedelta(seconds=max_age_s))))
        | ~session
    )


def _prune_rehydrations(engine: Engine, useless: Any, apply: bool, batch_size: int) -> int:
    """How many ``useless`` records there are; with ``apply``, delete them, ``batch_size``
    per transaction (a backlog is never one long transaction holding the writer lock)."""
    if not apply:
        with read_connection(engine) as conn:
            query = select(func.count()).select_from(_rehydrations).where(useless)
            return int(conn.execute(query).scalar_one())
    key = tuple_(*_rehydrations.primary_key.columns)
    batch = select(*_rehydrations.primary_key.columns).where(useless).limit(batch_size)
    statement = delete(_rehydrations).where(key.in_(batch), useless)
    pruned = 0
    while True:
        with write_transaction(engine) as conn:
            deleted = int(conn.execute(statement).rowcount)
        pruned += deleted
        if deleted < batch_size:
            return pruned


def _expired_totals(engine: Engine, moment: datetime) -> tuple[int, int]:
    query = select(func.count(), func.coalesce(func.sum(_artifacts.c.size_bytes), 0)).where(
        _artifacts.c.kind == OVERSIZED, _artifacts.c.expires_at <= moment
    )
    with read_connection(engine) as conn:
        count, size = conn.execute(query).one()
    return int(count), int(size)
