"""Staged artifact writes on any storage: ``fsio.StagedFile`` on the filesystem, and the
same protocol (``publish``/``commit``/``discard``) on object storage.

On object storage the content is uploaded, before any lock is taken, to a staging key in
the session's ``.tmp/`` prefix; ``publish`` (under the session's lock, into the directory
the session has then, so a move in between cannot strand it) is a server-side copy to the
target key; ``commit`` removes the staging key and the backup of a replaced object;
``discard`` puts a replaced object back (or removes a new one unless ``keep_new``). A
crash leaves at most a staging object, which no row names: never a partial object, and
never a row without its bytes (the row commits after the bytes are in place).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from core.artifacts.fsio import StagedDelete, StagedFile
from core.artifacts.paths import STAGING_DIR
from core.artifacts.storage import ArtifactStorage, FileArtifactStorage, key_of


class Staged(Protocol):
    def publish(self, session_root: Path, target: Path) -> None: ...

    def commit(self) -> None: ...

    def discard(self) -> None: ...


class ObjectStagedFile:
    def __init__(
        self,
        storage: ArtifactStorage,
        root: Path,
        session_root: Path,
        *,
        data: bytes | None = None,
        local: Path | None = None,
        keep_new: bool = True,
        on_chunk: Callable[[], None] | None = None,
    ) -> None:
        self._storage = storage
        self._root = root
        self._staged = key_of(root, session_root / STAGING_DIR / f"{uuid.uuid4().hex}.tmp")
        if local is not None:
            storage.put_file(self._staged, local, on_chunk=on_chunk)
        else:
            storage.put(self._staged, data or b"")
        self._keep_new = keep_new
        self._target: str | None = None
        self._backup: str | None = None

    def publish(self, session_root: Path, target: Path) -> None:
        key = key_of(self._root, target)
        if self._storage.size(key) is not None:
            backup = key_of(self._root, session_root / STAGING_DIR / f"{uuid.uuid4().hex}.bak")
            self._storage.copy(key, backup)
            self._backup = backup
        self._storage.copy(self._staged, key)
        self._target = key

    def commit(self) -> None:
        if self._backup is not None:
            self._storage.delete(self._backup)
            self._backup = None
        self._storage.delete(self._staged)

    def discard(self) -> None:
        if self._target is not None and self._backup is not None:
            self._storage.copy(self._backup, self._target)
            self._storage.delete(self._backup)
            self._backup = None
        elif self._target is not None and not self._keep_new:
            self._storage.delete(self._target)
        self._target = None
        self._storage.delete(self._staged)


def stage(
    storage: ArtifactStorage, root: Path, session_root: Path, data: bytes, *, keep_new: bool = True
) -> Staged:
    """Content staged for ``session_root`` on whichever storage holds the artifacts."""
    if isinstance(storage, FileArtifactStorage):
        return StagedFile(session_root, data, keep_new=keep_new)
    return ObjectStagedFile(storage, root, session_root, data=data, keep_new=keep_new)


@contextmanager
def staged_in(
    storage: ArtifactStorage, root: Path, session_root: Path, data: bytes, *, keep_new: bool = True
) -> Iterator[Staged]:
    """``stage`` for a block publishing inside a transaction: committed when the block
    succeeds, discarded when it raises (as ``fsio.staged_file``)."""
    staged = stage(storage, root, session_root, data, keep_new=keep_new)
    try:
        yield staged
    except BaseException:
        staged.discard()
        raise
    staged.commit()


class Deleted(Protocol):
    def commit(self) -> None: ...

    def rollback(self) -> None: ...


class ObjectStagedDelete:
    """``fsio.StagedDelete`` on object storage: copied aside now (server-side) and removed,
    the aside copy removed on ``commit``, copied back on ``rollback``."""

    def __init__(
        self, storage: ArtifactStorage, root: Path, session_root: Path, target: Path
    ) -> None:
        self._storage = storage
        self._target = key_of(root, target)
        self._aside: str | None = None
        if storage.size(self._target) is not None:
            aside = key_of(root, session_root / STAGING_DIR / f"{uuid.uuid4().hex}.del")
            storage.copy(self._target, aside)
            storage.delete(self._target)
            self._aside = aside

    def commit(self) -> None:
        if self._aside is not None:
            self._storage.delete(self._aside)
            self._aside = None

    def rollback(self) -> None:
        if self._aside is not None:
            self._storage.copy(self._aside, self._target)
            self._storage.delete(self._aside)
            self._aside = None


def staged_delete(
    storage: ArtifactStorage, root: Path, session_root: Path, target: Path
) -> Deleted:
    if isinstance(storage, FileArtifactStorage):
        return StagedDelete(session_root, target)
    return ObjectStagedDelete(storage, root, session_root, target)
