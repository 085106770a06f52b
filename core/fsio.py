"""Durable file mechanics, written once: fsync a directory, write a file durably, and
replace a file atomically (temporary file, fsync, rename, directory fsync).

Blobs, artifacts and the embedded queue's lock files all write through these.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path


def fsync_dir(directory: Path, *, strict: bool = True) -> None:
    """Make renames and new names in ``directory`` durable.

    ``strict=False``: a directory that cannot be opened (gone, or a platform without
    directory fsync) is not an error — for best-effort syncs after a change already made.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        if strict:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if strict:
            raise
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file at ``path`` and fsync it (the name is not synced)."""
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def replace_atomically(path: Path, data: bytes, *, prefix: str = ".tmp-") -> None:
    """Put ``data`` at ``path``: readers see the old content or the whole new one, and
    after a crash the file is one or the other. The directory must exist."""
    replace_many_atomically([(path, data)], prefix=prefix)


def replace_many_atomically(items: Sequence[tuple[Path, bytes]], *, prefix: str = ".tmp-") -> None:
    """``replace_atomically`` for several files, synced together: every temporary file is
    written, then each is fsynced (after the first, ext4 has usually committed the rest
    with it), then renamed, then each directory is fsynced once. A file is renamed only
    after its own fsync returned, so a crash never exposes a partial one."""
    fds: list[int] = []
    temps: list[tuple[str, Path]] = []
    try:
        try:
            for path, data in items:
                fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".part", dir=path.parent)
                fds.append(fd)
                temps.append((tmp, path))
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            for fd in fds:
                os.fsync(fd)
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        for tmp, path in temps:
            os.replace(tmp, path)
    except BaseException:
        for tmp, _ in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise
    for directory in dict.fromkeys(path.parent for path, _ in items):
        fsync_dir(directory)
