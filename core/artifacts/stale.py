"""Streamed tool outputs their writer left ``writing``: a process killed mid-write.

``ArtifactManager.allocate_path`` inserts a ``writing`` row before the first byte is
written; ``finalize_tool_output`` makes it ``complete``. A writer killed in between runs no
code after it, so the expiry job settles what it left, once the row is older than
``staging_max_age_seconds`` and (where it can be seen) its file has not changed for as long:

- on the filesystem the bytes written so far are kept and the row becomes ``truncated``
  with their size (0 if no file was ever made): a reader is told it is not the whole
  output, and nothing the tool produced is removed (an event may name ``artifact://<id>``,
  and a tool result is often a blob, which no cheap query reads);
- on object storage the bytes wait in a spool file of the writer's machine until
  ``finalize_tool_output`` uploads them whole. An object already there was uploaded by a
  finalize that died before its commit: it is the whole output, and the row becomes
  ``complete``. Otherwise a spool file left on this machine is uploaded after the row is
  marked ``truncated`` (a crash between the two leaves a truncated row without bytes, never
  partial bytes passed off as whole); with neither, the row is ``truncated`` at 0 bytes.

A finalize that commits after all wins (``rows.truncate_stale`` only changes a row still
``writing``, and ``finalize`` sets ``complete`` over ``truncated``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import Engine, select

from core import nofollow
from core.artifacts import rows
from core.artifacts.paths import decode_component, encode_component, session_dir
from core.artifacts.records import TOOL_OUTPUT, WRITING
from core.artifacts.storage import ArtifactStorage, FileArtifactStorage, key_of
from core.db import read_connection, write_transaction
from core.errors import SessionStoreError
from core.models import ArtifactRow, MoveIntentRow, table_of
from core.settings import Settings
from core.translate import storage_errors

log = logging.getLogger(__name__)

_moves = table_of(MoveIntentRow)
_artifacts = table_of(ArtifactRow)
MAX_ERRORS_KEPT = 50


@dataclass(slots=True)
class StaleWrites:
    """Tool outputs left ``writing``: settled (or, on a dry run, to settle) as ``truncated``
    or ``complete``, with the bytes they hold; ``errors`` of those left for the next run."""

    truncated: int = 0
    completed: int = 0
    bytes: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Found:
    size: int
    modified: float | None  # None: not known (an object, or nothing at all)
    whole: bool  # an uploaded object: a finalize got that far
    spool: Path | None = None  # a spool file of this machine, to upload


def finish_stale_writes(
    engine: Engine,
    settings: Settings,
    storage: ArtifactStorage,
    *,
    now: datetime,
    apply: bool,
    batch_size: int,
) -> StaleWrites:
    """Settle the tool outputs left ``writing`` before ``now`` less the staging age."""
    max_age = settings.staging_max_age_seconds
    cutoff = now - timedelta(seconds=max_age)
    report = StaleWrites()
    after = ("", "")
    while True:
        with read_connection(engine) as conn:
            batch = rows.stale_writes(conn, cutoff, batch_size, after=after)
        for session_id, tenant_id, artifact_id, name in batch:
            try:
                _settle(
                    engine,
                    settings,
                    storage,
                    (session_id, tenant_id, artifact_id, name),
                    cutoff=cutoff.timestamp(),
                    apply=apply,
                    report=report,
                )
            except (OSError, SessionStoreError) as exc:
                if len(report.errors) < MAX_ERRORS_KEPT:
                    report.errors.append(
                        f"cannot settle tool output {artifact_id} of session {session_id} "
                        f"left writing: {exc}"
                    )
        if len(batch) < batch_size:
            break
        after = (batch[-1][0], batch[-1][2])
    if report.truncated or report.completed:
        log.info(
            "tool outputs left writing settled",
            extra={"truncated": report.truncated, "completed": report.completed, "applied": apply},
        )
    return report


def _settle(
    engine: Engine,
    settings: Settings,
    storage: ArtifactStorage,
    row: tuple[str, str, str, str | None],
    *,
    cutoff: float,
    apply: bool,
    report: StaleWrites,
) -> None:
    session_id, tenant_id, artifact_id, name = row
    if _moving(engine, session_id):
        return  # its files' place is not settled: the next run
    root = settings.resolved_artifact_root
    target = session_dir(root, tenant_id, session_id) / (name or "")
    if isinstance(storage, FileArtifactStorage):
        found = _file(root, target) if name else _Found(0, None, whole=False)
    else:
        spool_dir = settings.artifact_spool_dir
        spool = spool_dir / encode_component(session_id) / (name or "")
        found = _object(storage, root, target, spool_dir, spool if name else None)
    if found.modified is not None and found.modified > cutoff:
        return  # still being written to: a long tool run, not a dead writer
    if not apply:
        _count(report, found)
        return
    with write_transaction(engine) as conn:
        if found.whole:
            settled = rows.finish_tool_output(conn, session_id, artifact_id, found.size)
        else:
            settled = rows.truncate_stale(conn, session_id, artifact_id, found.size)
    if not settled:
        return  # finalized (or removed) meanwhile
    _count(report, found)
    if found.spool is not None:
        _upload_spool(settings, storage, found.spool, key_of(root, target))


def _count(report: StaleWrites, found: _Found) -> None:
    if found.whole:
        report.completed += 1
    else:
        report.truncated += 1
    report.bytes += found.size


def _moving(engine: Engine, session_id: str) -> bool:
    with read_connection(engine) as conn:
        query = select(_moves.c.session_id).where(_moves.c.session_id == session_id)
        return conn.execute(query).first() is not None


@storage_errors("artifacts")
def _file(root: Path, path: Path) -> _Found:
    """The partial file's size and modification time (no link followed)."""
    fd = nofollow.open_file(root, path)
    if fd is None:
        return _Found(0, None, whole=False)
    try:
        stat = os.fstat(fd)
    finally:
        os.close(fd)
    return _Found(stat.st_size, stat.st_mtime, whole=False)


def _object(
    storage: ArtifactStorage, root: Path, target: Path, spool_dir: Path, spool: Path | None
) -> _Found:
    uploaded = storage.size(key_of(root, target))
    if uploaded is not None:
        return _Found(uploaded, None, whole=True)
    if spool is None:
        return _Found(0, None, whole=False)
    with storage_errors("artifacts"):
        fd = nofollow.open_file(spool_dir, spool)
    if fd is None:  # another machine's writer, or none ever written
        return _Found(0, None, whole=False)
    try:
        stat = os.fstat(fd)
    finally:
        os.close(fd)
    return _Found(stat.st_size, stat.st_mtime, whole=False, spool=spool)


def _upload_spool(settings: Settings, storage: ArtifactStorage, spool: Path, key: str) -> None:
    """The bytes a silent writer spooled, where a reader finds them. The spool stays: a
    writer that was only slow still holds it open, and its finalize uploads it whole (it
    was unlinked here, and that finalize failed, the rest of the output lost);
    ``sweep_spools`` removes it once it has not changed for the staging age again."""
    spool_dir = settings.artifact_spool_dir
    with storage_errors("artifacts"):
        fd = nofollow.open_file(spool_dir, spool)
        if fd is None:
            return
        with os.fdopen(fd, "rb") as source:
            storage.put_file(key, source)


def sweep_spools(engine: Engine, settings: Settings, *, now: datetime, apply: bool) -> int:
    """Remove spool files of this machine that no writer finalizes: unchanged for twice the
    staging age (``finish_stale_writes`` took the writer for dead after one, and uploaded
    what it had: the writer has had as long again to come back) and their row no longer
    ``writing`` (settled, or finalized by a process killed before it removed its spool), or
    gone. Returns how many (would be) removed."""
    spool_dir = settings.artifact_spool_dir
    cutoff = (now - timedelta(seconds=2 * settings.staging_max_age_seconds)).timestamp()
    removed = 0
    try:
        folders = list(os.scandir(spool_dir))
    except FileNotFoundError:
        return 0
    for folder in folders:
        session_id = decode_component(folder.name)
        if session_id is None or not folder.is_dir(follow_symlinks=False):
            continue
        for entry in os.scandir(folder.path):
            if not entry.is_file(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_mtime > cutoff:
                continue  # written to lately: a writer at work
            with read_connection(engine) as conn:
                state = conn.execute(
                    select(_artifacts.c.state).where(
                        _artifacts.c.session_id == session_id,
                        _artifacts.c.kind == TOOL_OUTPUT,
                        _artifacts.c.name == entry.name,
                    )
                ).scalar()
            if state == WRITING:
                continue  # finish_stale_writes settles it first (and uploads it)
            removed += 1
            if apply:
                with storage_errors("artifacts"):
                    nofollow.unlink(spool_dir, Path(entry.path))
    return removed
