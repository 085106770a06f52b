"""Durable file writes for artifacts: temporary file, fsync, rename.

A reader never sees a half-written artifact, and a write that is rolled back (quota
rejection, failed commit) leaves the previous content in place.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from core import nofollow
from core.artifacts.paths import OVERSIZED_DIR, STAGING_DIR, oversized_id_of
from core.errors import SymlinkRefused
from core.fsio import fsync_dir as sync_directory
from core.nofollow import artifact_root_of, check_path
from core.translate import storage_errors


def fsync_dir(directory: Path) -> None:
    """Best effort: the change it makes durable was already made."""
    sync_directory(directory, strict=False)


@storage_errors("artifacts")  # a full disk is StorageUnavailable, as on S3
def write_temp(session_root: Path, data: bytes) -> Path:
    """Write ``data`` to a fresh, fsynced file in the session's staging directory."""
    tmp = session_root / STAGING_DIR / f"{uuid.uuid4().hex}.tmp"
    nofollow.write_new(artifact_root_of(session_root), tmp, data)
    return tmp


class StagedFile:
    """Content written and fsynced in a session's staging directory before any lock is
    taken, then renamed into place (``publish``) while the session is locked.

    The staged file lives inside the session directory, so a move in between carries it
    along: ``publish`` takes the session directory as read under the lock, never the one
    seen when staging, and a file can never land in a directory the session has left. (If
    the move landed between reading the directory and staging, the staging re-created the
    old path: the file is taken from there and the empty leftovers are removed.)

    A rewrite keeps the previous content aside until ``commit``; ``discard`` puts it back.
    A new file that was published is removed by ``discard`` only if ``keep_new`` is false
    (files under a quota: usage must equal the bytes on disk); otherwise it stays, as its
    commit may have happened (a lost reply), and an unreferenced file is harmless where a
    lost one is not.
    """

    def __init__(self, session_root: Path, data: bytes, *, keep_new: bool = True) -> None:
        self._name = write_temp(session_root, data).name
        self._staged_in = session_root
        self._keep_new = keep_new
        self._target: Path | None = None
        self._backup: Path | None = None
        self._root = artifact_root_of(session_root)

    @classmethod
    def adopt(cls, session_root: Path, name: str, *, keep_new: bool = True) -> StagedFile:
        """A file a caller already wrote and fsynced (streamed) into the staging directory."""
        staged = cls.__new__(cls)
        staged._name = name
        staged._staged_in = session_root
        staged._keep_new = keep_new
        staged._target = None
        staged._backup = None
        staged._root = artifact_root_of(session_root)
        return staged

    @storage_errors("artifacts")
    def publish(self, session_root: Path, target: Path) -> None:
        root = artifact_root_of(session_root)
        staged = session_root / STAGING_DIR / self._name
        if not nofollow.exists(root, staged):  # staged under a path the session had just left
            staged = self._staged_in / STAGING_DIR / self._name
        if nofollow.exists(root, target):
            backup = session_root / STAGING_DIR / f"{uuid.uuid4().hex}.bak"
            _link_or_copy(root, target, backup)
            self._backup = backup
        nofollow.replace(root, staged, target)
        self._target = target
        self._root = root
        self._prune(session_root)

    @storage_errors("artifacts")
    def commit(self) -> None:
        if self._backup is not None:
            nofollow.unlink(self._root, self._backup)
            self._backup = None

    @storage_errors("artifacts")
    def discard(self) -> None:
        """Undo after a failure: the staged file goes, a replaced file comes back."""
        root = artifact_root_of(self._staged_in)
        if self._target is not None and self._backup is not None:
            nofollow.replace(root, self._backup, self._target)
            self._backup = None
        elif self._backup is not None:  # the publish failed after its backup: target as was
            nofollow.unlink(root, self._backup)
            self._backup = None
        elif self._target is not None and not self._keep_new:
            nofollow.unlink(root, self._target)
        self._target = None
        nofollow.unlink(root, self._staged_in / STAGING_DIR / self._name)

    def _prune(self, session_root: Path) -> None:
        # Empty directories staging re-created where the session no longer lives.
        if self._staged_in != session_root:
            root = self._staged_in.parent.parent  # <root>/<tenant>/<session>
            prune_empty_dirs(self._staged_in / STAGING_DIR, root)


@contextmanager
def staged_file(session_root: Path, data: bytes, *, keep_new: bool = True) -> Iterator[StagedFile]:
    """A ``StagedFile`` for a block that publishes it inside a transaction: committed when
    the block (and so the transaction) succeeds, discarded when it raises."""
    staged = StagedFile(session_root, data, keep_new=keep_new)
    try:
        yield staged
    except BaseException:
        staged.discard()
        raise
    staged.commit()


def _link_or_copy(root: Path, source: Path, backup: Path) -> None:
    # A hard link keeps the target in place (no window where readers miss the file).
    try:
        nofollow.link(root, source, backup)
    except SymlinkRefused:
        raise
    except OSError:
        data = nofollow.read_bytes(root, source)
        if data is None:
            raise SymlinkRefused(str(source)) from None  # not a regular file: never followed
        nofollow.write_new(root, backup, data)


class StagedDelete:
    """Move a file aside now, remove it on ``commit``, restore it on ``rollback``."""

    @storage_errors("artifacts")
    def __init__(self, session_root: Path, target: Path) -> None:
        self.target = target
        self._aside: Path | None = None
        self._root = artifact_root_of(session_root)
        if nofollow.exists(self._root, target):
            aside = session_root / STAGING_DIR / f"{uuid.uuid4().hex}.del"
            nofollow.replace(self._root, target, aside)
            self._aside = aside

    @storage_errors("artifacts")
    def commit(self) -> None:
        if self._aside is not None:
            nofollow.unlink(self._root, self._aside)
            self._aside = None

    @storage_errors("artifacts")
    def rollback(self) -> None:
        if self._aside is not None:
            nofollow.replace(self._root, self._aside, self.target)
            self._aside = None


def prune_empty_dirs(start: Path, stop: Path) -> None:
    """Remove empty directories from ``start`` up to (not including) ``stop`` (the
    artifact root or a directory below it)."""
    current = start
    root = stop
    while current != stop and stop in current.parents:
        try:
            nofollow.rmdir(root, current)
        except (OSError, SymlinkRefused):
            return
        current = current.parent


# Temporary files in a staging directory belong to the live operation that wrote them, which
# renames or removes them; only a killed process leaves one behind. (``.bak``/``.del`` hold
# previous content for a rollback and are left for an operator.)
TEMP_SUFFIXES = (".tmp", ".copy")


def sweep_staging(
    root: Path, *, older_than_s: float, apply: bool, now: float | None = None
) -> tuple[int, int]:
    """Temporary files left in the sessions' staging directories under ``root``, older
    than ``older_than_s``: (files, bytes), removed when ``apply``.

    Age is the inode change time: a fork copy sets its file's modification time back to
    the source's, but cannot set the change time.
    """
    cutoff = (time.time() if now is None else now) - older_than_s
    files = size = 0
    for tenant in _subdirs(root):
        for session in _subdirs(tenant):
            staging = os.path.join(session, STAGING_DIR)
            try:
                # A planted link in place of the staging directory is never followed.
                check_path(root, Path(staging))
                entries = list(os.scandir(staging))
            except (FileNotFoundError, NotADirectoryError, SymlinkRefused):
                continue
            for entry in entries:
                if not entry.name.endswith(TEMP_SUFFIXES):
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                    if info.st_ctime > cutoff or not entry.is_file(follow_symlinks=False):
                        continue
                    if apply:
                        nofollow.unlink(root, Path(entry.path))
                except FileNotFoundError:  # its operation finished meanwhile
                    continue
                files += 1
                size += info.st_size
    return files, size


def old_oversized_files(
    root: Path, *, older_than_s: float, now: float
) -> list[tuple[str, str, Path, int]]:
    """Oversized-output files (``<tenant>/<session>/oversized/art_*.txt``) under ``root``
    older than ``older_than_s`` by inode change time (set by their publish, a rename):
    (session directory name, artifact id, path, size) of each."""
    cutoff = now - older_than_s
    found = []
    for tenant in _subdirs(root):
        for session in _subdirs(tenant):
            directory = os.path.join(session, OVERSIZED_DIR)
            try:
                check_path(root, Path(directory))  # a planted link is never followed
                entries = list(os.scandir(directory))
            except (FileNotFoundError, NotADirectoryError, SymlinkRefused):
                continue
            for entry in entries:
                artifact_id = oversized_id_of(entry.name)
                if artifact_id is None:
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if info.st_ctime <= cutoff and entry.is_file(follow_symlinks=False):
                    name = os.path.basename(session)
                    found.append((name, artifact_id, Path(entry.path), info.st_size))
    return found


def _subdirs(directory: Path | str) -> list[str]:
    try:
        with os.scandir(directory) as entries:
            return [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []
