"""No symlink under the data root is ever followed (invariant 9).

Every artifact read, write, copy, move, delete and expiry checks its path here first:
each directory component below the artifact root is ``lstat``-ed (a symlink anywhere is
refused), and files are opened with ``O_NOFOLLOW`` so a link planted at the leaf is refused
too. Reads open every directory component with ``O_NOFOLLOW`` relative to the previous
one's descriptor, so swapping a component for a link between the check and the open does
not help either.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from core.errors import InvalidArtifactPath, SymlinkRefused

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _parts(root: Path, path: Path) -> tuple[str, ...]:
    try:
        return Path(path).relative_to(root).parts
    except ValueError:
        raise InvalidArtifactPath(str(path), "outside the artifact root") from None


def check_path(root: Path, path: Path, *, leaf: bool = True) -> None:
    """Refuse ``path`` if any existing component below ``root`` (the leaf too, with
    ``leaf``) is a symlink; components that do not exist yet end the walk."""
    parts = _parts(root, path)
    current = Path(root)
    for part in parts if leaf else parts[:-1]:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return
        if stat.S_ISLNK(mode):
            raise SymlinkRefused(str(current))


def open_file(root: Path, path: Path) -> int | None:
    """A read-only descriptor of the regular file at ``path``, reached without following
    any link below ``root``; None when there is no such file."""
    parts = _parts(root, path)
    if not parts:
        return None
    try:
        fd = os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    for part in parts[:-1]:
        fd = _step(fd, part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, path)
        if fd < 0:
            return None
    fd = _step(fd, parts[-1], os.O_RDONLY | _NOFOLLOW | _CLOEXEC, path)
    if fd < 0:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _step(dir_fd: int, name: str, flags: int, path: Path) -> int:
    """Open ``name`` inside ``dir_fd``, which it closes; -1 when there is no such entry."""
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError, OSError) as exc:
        if _is_link(dir_fd, name) or exc.errno == errno.ELOOP:
            raise SymlinkRefused(str(path)) from None
        if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
            return -1
        raise
    finally:
        os.close(dir_fd)


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def read_bytes(root: Path, path: Path) -> bytes | None:
    """The content of the regular file at ``path`` (no link followed); None if absent."""
    fd = open_file(root, path)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def mtime(root: Path, path: Path) -> float | None:
    """Modification time of the regular file at ``path`` (no link followed); None if absent."""
    fd = open_file(root, path)
    if fd is None:
        return None
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)


def unlink(root: Path, path: Path) -> None:
    """Remove the file at ``path``, if any, reached through no symlink. A link at the leaf
    is removed itself (unlink never touches a link's target)."""
    check_path(root, path, leaf=False)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def artifact_root_of(session_root: Path) -> Path:
    """The artifact root above a session directory (``<root>/<tenant>/<session>``)."""
    return Path(session_root).parent.parent


def size(root: Path, path: Path) -> int:
    """Size of the regular file at ``path`` (no link followed); FileNotFoundError if none."""
    fd = open_file(root, path)
    if fd is None:
        raise FileNotFoundError(errno.ENOENT, "no such artifact file", str(path))
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def create_new(path: Path) -> int:
    """A write descriptor of a new file at ``path``: never through a link at the leaf, and
    never onto an existing file (callers checked the directories with ``check_path``)."""
    check_path(artifact_root_of(path.parent), path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    return os.open(path, flags, 0o644)
