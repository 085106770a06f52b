"""Path-addressed files of one session, with per-file, per-session and per-tenant quotas.

Quota arithmetic and the file write happen under one lock: the write transaction holds
the tenant's quota lock (``rows.lock_quota``) while it sums usage from the ``artifacts``
rows, checks the limits, renames the new content into place and upserts the row. The
transaction commits before anyone else of the tenant can read usage, so concurrent writers
cannot overshoot, and the rows always sum to the bytes on disk.
"""

from __future__ import annotations

import builtins
import errno
import logging
import mimetypes
import os
import stat
from pathlib import Path

from sqlalchemy import Connection

from core import nofollow
from core.artifacts import integrity, rows
from core.artifacts.fsio import prune_empty_dirs
from core.artifacts.inherited import preserve_for_forks, read_artifact_file
from core.artifacts.paths import FILES_DIR, contained_path, file_name, sanitize_path
from core.artifacts.records import FILE, ArtifactInfo, FileWriteResult, QuotaUsage
from core.artifacts.scope import SessionScope
from core.artifacts.staging import Deleted, Staged, staged_delete, staged_in
from core.db import read_connection, write_transaction
from core.errors import ArtifactError, ArtifactNotFound, InvalidArtifactPath, QuotaExceeded
from core.models import utcnow
from core.translate import storage_errors

logger = logging.getLogger(__name__)


def _media_type(path: str, data: str | bytes, media_type: str | None) -> str:
    if media_type:
        return media_type
    guessed = mimetypes.guess_type(path)[0]
    if guessed:
        return guessed
    return "text/plain" if isinstance(data, str) else "application/octet-stream"


class SessionFiles:
    """put / get / list / delete by path, under ``files/`` of the session directory."""

    def __init__(self, scope: SessionScope) -> None:
        self._scope = scope

    @property
    def _session_id(self) -> str:
        return self._scope.session_id

    def put(
        self, path: str, data: str | bytes, *, media_type: str | None = None
    ) -> FileWriteResult:
        """Create or replace the file at ``path``; reports usage after the write."""
        rel = sanitize_path(path)
        body = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        self._check_file_quota(len(body))
        media = _media_type(rel, data, media_type)
        directory = self._scope.directory()
        target = contained_path(directory / FILES_DIR, rel)
        with (
            staged_in(
                self._scope.storage(), self._scope.root, directory, body, keep_new=False
            ) as staged,
            write_transaction(self._scope.engine) as conn,
        ):
            result = self._put_locked(
                conn, directory, rel, (len(body), integrity.digest(body)), media, staged, target
            )
        logger.debug(
            "artifact file written", extra={"session_id": self._session_id, **result.to_dict()}
        )
        return result

    def _put_locked(
        self,
        conn: Connection,
        directory: Path,
        rel: str,
        content: tuple[int, str],
        media_type: str,
        staged: Staged,
        target: Path,
    ) -> FileWriteResult:
        size, sha256 = content  # of the bytes staged
        info = rows.lock_for_write(conn, self._session_id)
        if self._scope.dir_for(info.tenant_id) != directory:
            raise ArtifactError(f"session {self._session_id} moved during the write; retry")
        clash = rows.file_conflict(conn, self._session_id, rel)
        if clash is not None:
            raise InvalidArtifactPath(rel, f"conflicts with the existing file {clash!r}")
        old = rows.get_artifact(conn, self._session_id, FILE, rel)
        old_size = old.size_bytes if old is not None else 0
        session_used = rows.session_file_usage(conn, self._session_id) - old_size
        tenant_used = rows.tenant_file_usage(conn, info.tenant_id) - old_size
        if size > old_size:
            # Shrinking or same-size rewrites always pass, even above a lowered quota.
            settings = self._scope.settings
            self._check("session", settings.quota_session_bytes, session_used, size)
            self._check("tenant", settings.quota_tenant_bytes, tenant_used, size)
        rows.upsert_artifact(
            conn,
            {
                "session_id": self._session_id,
                "kind": FILE,
                "local_id": rel,
                "name": file_name(rel),
                "size_bytes": size,
                "sha256": sha256,
                "media_type": media_type,
                "created_at": utcnow(),
                # The row describes this content: an overwrite is a creation at today's head.
                "created_seq": info.head_seq,
            },
        )
        if old is not None:
            preserve_for_forks(
                conn, self._scope.root, self._session_id, old, target, storage=self._scope.objects
            )
        if self._scope.objects is None:  # object storage has no directories in the way
            self._clear_stale_dir(target)
        staged.publish(directory, target)
        return FileWriteResult(
            path=rel,
            size_bytes=size,
            replaced_bytes=old_size,
            session_used_bytes=session_used + size,
            tenant_used_bytes=tenant_used + size,
        )

    def get(self, path: str) -> bytes:
        """The content of the file at ``path`` (ArtifactNotFound if there is none)."""
        rel = sanitize_path(path)
        with read_connection(self._scope.engine) as conn:
            info = rows.session_info(conn, self._session_id)
            row = rows.get_artifact(conn, self._session_id, FILE, rel)
        if row is None:
            raise ArtifactNotFound(f"no file at {rel!r}")

        own = contained_path(self._scope.dir_for(info.tenant_id) / FILES_DIR, rel)
        data = read_artifact_file(
            self._scope.engine, self._scope.root, own, row, self._scope.objects
        )
        if data is None:
            raise ArtifactNotFound(f"no file at {rel!r}")
        return data

    def stat(self, path: str) -> ArtifactInfo:
        rel = sanitize_path(path)
        with read_connection(self._scope.engine) as conn:
            row = rows.get_artifact(conn, self._session_id, FILE, rel)
        if row is None:
            raise ArtifactNotFound(f"no file at {rel!r}")
        return row

    def list(self, prefix: str | None = None) -> list[ArtifactInfo]:
        """Files in path order; ``prefix`` keeps one directory's subtree (or that one file)."""
        canonical = sanitize_path(prefix) if prefix else None
        with read_connection(self._scope.engine) as conn:
            found = rows.list_artifacts(conn, self._session_id, FILE, prefix=canonical)
        return sorted(found, key=lambda a: a.local_id)

    def delete(self, path: str) -> FileWriteResult:
        """Remove the file at ``path``; reports usage after the delete."""
        rel = sanitize_path(path)
        aside: builtins.list[Deleted] = []
        try:
            with write_transaction(self._scope.engine) as conn:
                result = self._delete_locked(conn, rel, aside)
        except BaseException:
            for staged in aside:
                staged.rollback()
            raise
        for staged in aside:
            staged.commit()
        return result

    def _delete_locked(
        self, conn: Connection, rel: str, aside: builtins.list[Deleted]
    ) -> FileWriteResult:
        info = rows.lock_for_write(conn, self._session_id)
        old = rows.get_artifact(conn, self._session_id, FILE, rel)
        if old is None:
            raise ArtifactNotFound(f"no file at {rel!r}")
        rows.delete_artifact(conn, self._session_id, FILE, rel)
        files_root = self._scope.dir_for(info.tenant_id) / FILES_DIR
        target = contained_path(files_root, rel)
        root, objects = self._scope.root, self._scope.objects
        preserve_for_forks(conn, root, self._session_id, old, target, storage=objects)
        aside.append(staged_delete(self._scope.storage(), root, files_root.parent, target))
        if objects is None:
            # Inside the lock: no concurrent put of this tenant is creating these directories.
            prune_empty_dirs(target.parent, files_root)
        return FileWriteResult(
            path=rel,
            size_bytes=0,
            replaced_bytes=old.size_bytes,
            session_used_bytes=rows.session_file_usage(conn, self._session_id),
            tenant_used_bytes=rows.tenant_file_usage(conn, info.tenant_id),
        )

    def usage(self) -> QuotaUsage:
        """Bytes of path-addressed files in this session and in its tenant."""
        with read_connection(self._scope.engine) as conn:
            info = rows.session_info(conn, self._session_id)
            return QuotaUsage(
                rows.session_file_usage(conn, self._session_id),
                rows.tenant_file_usage(conn, info.tenant_id),
            )

    # internals -----------------------------------------------------------------------------

    def _check_file_quota(self, size: int) -> None:
        limit = self._scope.settings.quota_file_bytes
        if size > limit:
            self._reject("file", limit, 0, size)

    def _check(self, scope: str, limit: int, used_without_old: int, size: int) -> None:
        if used_without_old + size > limit:
            self._reject(scope, limit, used_without_old, size)

    def _reject(self, scope: str, limit: int, used: int, size: int) -> None:
        logger.info(
            "artifact quota exceeded",
            extra={"session_id": self._session_id, "scope": scope, "limit": limit, "used": used},
        )
        raise QuotaExceeded(scope, limit=limit, used=used, requested=size)

    @storage_errors("artifacts")
    def _clear_stale_dir(self, target: Path) -> None:
        """An empty directory left where the new file goes is removed; a full one conflicts."""
        try:
            with nofollow.parent_dir(self._scope.root, target) as (fd, name):
                if not stat.S_ISDIR(os.lstat(name, dir_fd=fd).st_mode):
                    return
                try:
                    os.rmdir(name, dir_fd=fd)
                except OSError as exc:
                    if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise  # the disk failing: StorageUnavailable, not bad input
                    raise InvalidArtifactPath(
                        str(target.name), "a directory is in the way"
                    ) from exc
        except (FileNotFoundError, NotADirectoryError):
            return
