"""A fork's artifact copy: the inherited files, copied after the fork committed.

The copy never overwrites: each file is staged in the fork's directory and published with
``link`` (which fails if the name exists), then the staged name is removed, so every file
has one name afterwards and the parent's later writes never show through. Running the copy
twice, or two copies at once, is safe. A Celery task runs it in the queue setup.

A storage outage (a full disk, the object store away: ``core.translate``'s transient
errors) leaves the copy pending and raises ``StorageUnavailable``: the task retries it, the
reconciler re-enqueues it, and the parent is neither deleted nor moved before it finishes
(invariant 12). Only a permanent cause (changed in the parent, a refused path) ends it
``failed``.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from sqlalchemy import Connection, Select, select, update

from core import nofollow
from core.artifacts import integrity, rows
from core.artifacts.inherited import (
    Ancestors,
    SourceChanged,
    ancestor_file,
    copy_object_for_fork,
    held_dir,
)
from core.artifacts.paths import STAGING_DIR, agent_output_names, contained_path, session_dir
from core.artifacts.records import AGENT_OUTPUT, ArtifactInfo
from core.artifacts.storage import (
    ArtifactStorage,
    FileArtifactStorage,
    Tally,
    artifact_storage_for,
    key_of,
    key_prefix_of,
)
from core.db import read_connection, write_transaction
from core.errors import ForkCopyBlocked, SessionNotFound, StorageUnavailable, SymlinkRefused
from core.journal import Journal
from core.journal.validation import check_limit, check_seconds
from core.metrics import metrics
from core.models import SessionRow, database_now, table_of, utcnow
from core.nofollow import open_file
from core.records import COPY_DONE, COPY_FAILED, COPY_PENDING, Session
from core.sessions.queries import children, session_or_none
from core.settings import Settings
from core.translate import is_unavailable

log = logging.getLogger(__name__)

_sessions = table_of(SessionRow)
_MAX_REASONS = 5
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK}


class ForkCopier(Protocol):
    """Hands a committed fork's artifact copy to whatever runs it (the queue)."""

    def __call__(self, fork: Session, /) -> None: ...


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
    # artifacts not copied because a symlink stood in their path (never followed)
    skipped_symlinks: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class _CopyItem:
    row: ArtifactInfo
    source: Path
    target: Path


@dataclass(slots=True)
class _CopyPlan:
    fork: Session
    directory: Path
    items: list[_CopyItem] = field(default_factory=list)
    present: int = 0
    missing: int = 0
    lost: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _CopyOutcome:
    copied: int = 0
    bytes: int = 0
    present: int = 0
    errors: list[str] = field(default_factory=list)
    # not copied for a storage outage (transient): a retry can copy them
    unavailable: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


class ForkCopies:
    """Runs and tracks the artifact copies of forks."""

    def __init__(self, journal: Journal, settings: Settings) -> None:
        self.journal = journal
        self.engine = journal.engine
        self.settings = settings
        self.root = settings.resolved_artifact_root
        self.storage = artifact_storage_for(settings)
        # None: the filesystem at ``root``, copied by descriptor and published with a hard
        # link (never over a file, the mtime checked on the one open file), which the
        # interface's ``copy`` cannot say; else objects, copied server-side.
        self.objects = None if isinstance(self.storage, FileArtifactStorage) else self.storage

    def hand_over(self, fork: Session, copier: ForkCopier | None) -> Session:
        """Start a new fork's pending copy: through ``copier`` (the queue), or here and now."""
        if fork.copy_status != COPY_PENDING:
            return fork
        if copier is None:
            try:
                self.copy_artifacts(fork.id)
            except StorageUnavailable as exc:
                # The fork is committed and usable; its copy stays pending for a retry.
                log.warning(
                    "the fork's artifact copy met a storage outage; it stays pending",
                    extra={"fork_id": fork.id, "error": str(exc)},
                )
            return self.journal.get_session(fork.id)
        try:
            copier(fork)
        except Exception as exc:
            # The fork is committed and usable; the reconciler re-enqueues its copy.
            log.warning(
                "could not hand the fork's artifact copy over; the reconciler will retry",
                extra={"fork_id": fork.id, "error": repr(exc)},
            )
        return fork

    def copy_artifacts(self, fork_id: str) -> CopyReport:
        """Copy a fork's inherited artifact files into its own directory (idempotent).

        Runs for ``pending`` and ``failed`` forks (a re-run retries a failed copy); anything
        else is reported as it is. Permanent copy errors end as status ``failed`` with the
        reason; a storage outage leaves it ``pending`` with the reason and raises
        ``StorageUnavailable`` (retry later).
        """
        with read_connection(self.engine) as conn:
            fork = self.journal.session_in(conn, fork_id)
            if fork.copy_status not in (COPY_PENDING, COPY_FAILED):
                return CopyReport(fork_id, fork.copy_status)
            plan = _plan_copy(conn, self.journal, self.root, fork, self.objects)
        started = time.perf_counter()
        outcome = _run_copy(plan, self.root, self.objects)
        observed = metrics()
        observed.fork_copy_seconds.observe(time.perf_counter() - started)
        observed.fork_copy_bytes.inc(outcome.bytes)
        report = self._finish_copy(plan, outcome)
        if outcome.unavailable and report.status == COPY_PENDING:
            # A report would end the queue's task as done: the type makes it retry.
            raise StorageUnavailable(
                "artifacts",
                f"fork {fork_id}: its artifact copy stays pending, to be retried: {report.error}",
            )
        return report

    def _finish_copy(self, plan: _CopyPlan, outcome: _CopyOutcome) -> CopyReport:
        skipped = plan.skipped + outcome.skipped
        permanent = plan.lost + outcome.errors
        # An artifact skipped (a link) or not copied for an outage is not copied yet: the
        # copy stays pending, so the reconciler retries it until the link is removed or
        # the storage is back (then the fork gets the file). An outage also outranks a
        # permanent error: ``failed`` is not retried, and what it kept from the fork can
        # still be copied.
        if outcome.unavailable:
            status = COPY_PENDING
        else:
            status = COPY_FAILED if permanent else COPY_PENDING if skipped else COPY_DONE
        reasons = permanent + outcome.unavailable
        reasons += [f"{where} (a symlink, not followed)" for where in skipped]
        total = len(plan.items) + len(plan.lost) + len(plan.skipped)
        error = _summarize(reasons, total) if reasons else None
        with write_transaction(self.engine) as conn:
            changed = conn.execute(
                update(_sessions)
                .where(
                    _sessions.c.id == plan.fork.id,
                    _sessions.c.copy_status.in_([COPY_PENDING, COPY_FAILED]),
                )
                .values(copy_status=status, copy_error=error)
            ).rowcount
            current = session_or_none(conn, self.journal, plan.fork.id)
            parent = (
                session_or_none(conn, self.journal, plan.fork.parent_id)
                if plan.fork.parent_id and status == COPY_DONE
                else None
            )
        self._drop_stale_directory(plan, current)
        if parent is not None:
            self._drop_held(plan.fork.id, parent)
        report = CopyReport(
            fork_id=plan.fork.id,
            status=current.copy_status if current is not None else None,
            copied=outcome.copied,
            bytes_copied=outcome.bytes,
            already_present=plan.present + outcome.present,
            missing_at_source=plan.missing,
            error=error,
            skipped_symlinks=skipped,
        )
        _log_copy(plan, report, changed=bool(changed))
        return report

    def _drop_stale_directory(self, plan: _CopyPlan, current: Session | None) -> None:
        """A fork deleted (or moved) while this copy ran: what we wrote is nobody's."""
        if current is not None and session_dir(self.root, current.tenant_id, current.id) == (
            plan.directory
        ):
            return
        try:
            self.storage.delete_prefix(key_prefix_of(self.root, plan.directory))
        except (OSError, SymlinkRefused, StorageUnavailable) as exc:
            log.warning("could not remove a stale fork copy", extra={"error": str(exc)})

    def _drop_held(self, fork_id: str, parent: Session) -> None:
        """The copy is done: what the parent held for the fork (``held_dir``) is no use."""
        if self.objects is not None:
            return  # held beside the parent on the file store only (preserve_for_forks)
        held = held_dir(session_dir(self.root, parent.tenant_id, parent.id), fork_id)
        try:
            self.storage.delete_prefix(key_prefix_of(self.root, held))
        except (OSError, SymlinkRefused, StorageUnavailable) as exc:
            log.warning("could not remove files held for a fork", extra={"error": str(exc)})

    def pending_forks(self, *, older_than_s: float, limit: int = 1000) -> list[str]:
        """Forks whose copy has been pending for longer than ``older_than_s``, oldest first."""
        age = check_seconds(older_than_s, "older_than_s")
        query = pending_forks_query(utcnow() - timedelta(seconds=age), check_limit(limit))
        with read_connection(self.engine) as conn:
            return [str(v) for v in conn.execute(query).scalars()]

    def settle(self, session_id: str, *, include_self: bool, action: str) -> None:
        """Finish the copies that read from this session's directory (and, for a move, its
        own: a copy running during the rename would write into the old directory).
        ``ForkCopyBlocked`` when one cannot finish (a planted symlink keeps it pending):
        ``action`` (the move, the delete) would wait on it forever. ``StorageUnavailable``
        when a storage outage keeps it pending: retry ``action`` once the storage is back
        (going ahead would take what the fork has not copied yet)."""
        with read_connection(self.engine) as conn:
            fork_ids = children(conn, session_id, statuses=(COPY_PENDING, COPY_FAILED))
            own = self.journal.session_in(conn, session_id).copy_status
        if include_self and own == COPY_PENDING:
            fork_ids.append(session_id)
        for fork_id in fork_ids:
            try:
                report = self.copy_artifacts(fork_id)
            except SessionNotFound:
                continue
            except StorageUnavailable as exc:
                whose = "its own" if fork_id == session_id else f"its fork {fork_id}'s"
                raise StorageUnavailable(
                    exc.component,
                    f"session {session_id}: cannot {action} it before {whose} artifact copy "
                    f"finishes; retry once the storage is back ({exc})",
                ) from exc
            if report.skipped_symlinks:  # pending, or failed as well: what it skipped is not copied
                raise ForkCopyBlocked(session_id, fork_id, report.skipped_symlinks, action)

    # move -----------------------------------------------------------------------------------


def pending_forks_query(cutoff: datetime, limit: int) -> Select[tuple[str]]:
    """Forks with a pending copy created before ``cutoff``, oldest first (indexed by
    ``ix_sessions_copy_status_created``)."""
    return (
        select(_sessions.c.id)
        .where(_sessions.c.copy_status == COPY_PENDING, _sessions.c.created_at <= cutoff)
        .order_by(_sessions.c.created_at)
        .limit(limit)
    )


def _plan_copy(
    conn: Connection, journal: Journal, root: Path, fork: Session, objects: ArtifactStorage | None
) -> _CopyPlan:
    plan = _CopyPlan(fork, session_dir(root, fork.tenant_id, fork.id))
    # The database's clock read once, if any row needs it, for every row it judges
    now = functools.cache(lambda: database_now(conn))
    ancestors = Ancestors(conn, journal, every_row=True)  # read once, not once a row
    for row in rows.list_artifacts(conn, fork.id):
        if not row.name:
            continue
        try:
            target = _target(root, plan.directory, row.name, objects)
            if _exists(root, target, objects):
                plan.present += 1
                continue
        except SymlinkRefused as exc:
            plan.skipped.append(_skip(plan.fork, row, exc))
            continue
        found = ancestor_file(ancestors, root, fork, row, objects)
        if found.path is not None:
            plan.items.append(_CopyItem(row, found.path, target))
        elif found.inherited:
            plan.missing += 1  # the ancestor has no file either (none was ever written)
        elif ancestors.inherited(fork.id, row.kind, row.local_id) and not rows.has_expired(
            conn, row, now=now
        ):
            plan.lost.append(f"{row.kind} {row.local_id}: changed or removed in the parent")
    return plan


def _target(root: Path, directory: Path, name: str, objects: ArtifactStorage | None) -> Path:
    """The fork's own path for an artifact. A link on the way (or at it) is refused first:
    ``contained_path`` resolves links, and would take one for an escape or for the fork's."""
    if objects is None:
        nofollow.check_path(root, directory / name)
    return contained_path(directory, name)


def _skip(fork: Session, row: ArtifactInfo, exc: SymlinkRefused) -> str:
    log.warning("fork copy skipped a symlink", extra={"fork_id": fork.id, "path": exc.path})
    return f"{row.kind} {row.local_id}: {exc.path}"


def _run_copy(plan: _CopyPlan, root: Path, objects: ArtifactStorage | None) -> _CopyOutcome:
    outcome = _CopyOutcome()
    staging = plan.directory / STAGING_DIR
    for item in plan.items:
        where = f"{item.row.kind} {item.row.local_id}"
        try:
            size = _copy_item(item, staging, root, objects)
        except SymlinkRefused as exc:
            outcome.skipped.append(_skip(plan.fork, item.row, exc))
            continue
        except SourceChanged:
            outcome.errors.append(f"{where}: changed in the parent after the fork")
        except FileNotFoundError as exc:
            outcome.errors.append(f"{where}: vanished during the copy ({exc.filename})")
        except (OSError, StorageUnavailable) as exc:
            reasons = outcome.unavailable if is_unavailable(exc) else outcome.errors
            reasons.append(f"{where}: {exc}")
        else:
            if size is None:
                outcome.present += 1
            else:
                outcome.copied += 1
                outcome.bytes += size
    return outcome


def _exists(root: Path, path: Path, objects: ArtifactStorage | None) -> bool:
    """Whether the fork has this file; a link there is no file of its (``SymlinkRefused``)."""
    if objects is None:
        return nofollow.exists(root, path, refuse_link=True)
    return objects.size(key_of(root, path)) is not None


def _copy_item(
    item: _CopyItem, staging: Path, root: Path, objects: ArtifactStorage | None
) -> int | None:
    """Copy one artifact (an agent output's JSONL sidecar first: the markdown file marks it
    complete); bytes copied, or None if the fork already had it."""
    extra: int | None = 0
    try:
        # its sidecar, unless written without one (a file an earlier write left is not its)
        if item.row.kind == AGENT_OUTPUT and item.row.sidecar_sha256 != integrity.NO_SIDECAR:
            sidecar = agent_output_names(item.row.local_id)[1]
            source = item.source.with_name(sidecar)
            target = item.target.with_name(sidecar)
            extra = _copy(objects, item, source, target, staging, root, optional=True)
        size = _copy(objects, item, item.source, item.target, staging, root)
    except FileNotFoundError:
        # another copy may have finished it (a link there is refused: SymlinkRefused)
        if _exists(root, item.target, objects):
            return None
        raise
    return None if size is None else size + (extra or 0)


def _copy(
    objects: ArtifactStorage | None,
    item: _CopyItem,
    source: Path,
    target: Path,
    staging: Path,
    root: Path,
    *,
    optional: bool = False,
) -> int | None:
    if objects is None:
        return _copy_file(source, target, staging, item.row, root, optional=optional)
    try:  # server-side, checked against the row (no clock of another host's compared)
        return copy_object_for_fork(objects, root, source, target, item.row)
    except FileNotFoundError:
        if optional:
            return None
        raise FileNotFoundError(errno.ENOENT, "no such artifact object", str(source)) from None


def _copy_file(
    source: Path,
    target: Path,
    staging: Path,
    row: ArtifactInfo,
    root: Path,
    *,
    optional: bool = False,
) -> int | None:
    """An independent, fsynced copy at ``target`` unless a file is there already, only as
    the content ``row`` recorded (``SourceChanged`` if it is not, and the fork has none).

    The bytes are checked as they are copied, before the copy takes its name: the parent
    replaces files by rename, and a rewrite racing the copy first gives the fork a link to
    the old file (``preserve_for_forks``), which the copy then leaves alone. No symlink is
    followed, on either side (``SymlinkRefused``). ``optional``: a missing source is no
    error (None).
    """
    if nofollow.exists(root, target, refuse_link=True):
        return None
    fd = open_file(root, source)
    if fd is None:
        if optional:
            return None
        raise FileNotFoundError(errno.ENOENT, "no such artifact file", str(source))
    tmp = staging / f"{uuid.uuid4().hex}.copy"
    tally = Tally()
    try:
        with os.fdopen(fd, "rb") as src:
            times = os.fstat(src.fileno())
            with os.fdopen(nofollow.create_new(root, tmp), "wb") as dst:
                shutil.copyfileobj(_Tallied(src, tally), dst, 1 << 20)
                dst.flush()
                os.fsync(dst.fileno())
                os.utime(dst.fileno(), ns=(times.st_atime_ns, times.st_mtime_ns))
        reason = integrity.file_mismatch(row, target.name, *tally.measured)
        if reason is not None:
            if nofollow.exists(root, target, refuse_link=True):
                return None  # the fork's own (the parent's write kept it one)
            raise SourceChanged(errno.ESTALE, f"not the content the fork inherited: {reason}")
        if not _publish_new(root, tmp, target):
            return None
    finally:
        nofollow.unlink(root, tmp)
    return tally.size


class _Tallied:
    """A binary file whose reads are counted and hashed (``Tally``) as they pass."""

    def __init__(self, source: BinaryIO, tally: Tally) -> None:
        self._source = source
        self._tally = tally

    def read(self, size: int = -1) -> bytes:
        return self._tally.add(self._source.read(size))


def _publish_new(root: Path, tmp: Path, target: Path) -> bool:
    """Give the staged copy its name unless the name exists (never overwrite); fsynced."""
    try:
        nofollow.link(root, tmp, target)  # the staged name is removed right after
    except FileExistsError:
        # taken since the check: by another copy, or by a link (refused, not taken as one)
        nofollow.exists(root, target, refuse_link=True)
        return False
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        # a filesystem without hard links: a rename that never replaces either
        try:
            nofollow.rename_new(root, tmp, target)
        except FileExistsError:
            nofollow.exists(root, target, refuse_link=True)
            return False
        return True
    with nofollow.parent_dir(root, target) as (dir_fd, _name):
        os.fsync(dir_fd)
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
        log.warning("fork artifact copy %s: %s", report.status, report.error, extra=extra)
    else:
        log.info("fork artifact copy finished", extra=extra)
