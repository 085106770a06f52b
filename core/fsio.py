"""Durable file mechanics, written once: fsync a directory, write a file durably, and
replace a file atomically (temporary file, fsync, rename, directory fsync).

Blobs, artifacts and the embedded queue's lock files all write through these.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
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
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".part", dir=path.parent)
    try:
        with open(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
