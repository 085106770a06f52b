"""No symlink under the data root is ever followed (invariant 9).

Every artifact and blob-file read, write, copy, move, delete and expiry goes through here.
Nothing acts on a path that was checked earlier: each operation opens the directories below
its root (the artifact root, the blob root) one component at a time, relative to the
previous one's descriptor, with ``O_NOFOLLOW | O_DIRECTORY`` (creating missing ones with
``mkdir`` at that descriptor), and then acts on the leaf name relative to its parent's
descriptor (``openat``, ``renameat``, ``linkat``, ``unlinkat``; files with ``O_NOFOLLOW``).
A link anywhere is refused with ``SymlinkRefused``, and swapping a component for a link
between two calls does not help: the descriptor already held is the real directory.
Files are opened for reading with ``O_NONBLOCK`` and kept only if regular: a FIFO planted
at a file's name is no file (as absent), never a reader blocked in ``open`` for a writer.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

from core.errors import InvalidArtifactPath, SymlinkRefused

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# A leaf is opened without blocking: opening a FIFO planted there for reading would wait
# for a writer forever. Only a regular file is kept (``_regular``), in blocking mode.
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_LEAF_FLAGS = os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC


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


def first_link(root: Path, path: Path) -> Path | None:
    """The first component of ``path`` below ``root`` that is a symlink (what to remove when
    an operation there was refused), or None."""
    try:
        check_path(root, path)
    except SymlinkRefused as exc:
        return Path(exc.path)
    except InvalidArtifactPath:
        return None
    return None


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
    fd = _step(fd, parts[-1], _LEAF_FLAGS, path)
    return None if fd < 0 else _regular(fd)


def _regular(fd: int) -> int | None:
    """``fd`` in blocking mode if it is a regular file; else None (and it is closed): a
    FIFO, socket or device is no artifact or blob file."""
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        if regular and _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    if not regular:
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


_DIR_FLAGS = os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC


def _walk(
    root: Path,
    parts: tuple[str, ...],
    path: Path,
    *,
    create: bool,
    made: set[tuple[str, ...]] | None = None,
) -> int:
    """A descriptor of ``root/parts``, each component opened without following a link
    (made first when missing, with ``create``). FileNotFoundError when one is missing.
    ``made`` collects the directories (as parts below ``root``) this walk added an entry
    to, for ``sync_dirs``.

    The root itself is the configured one: it may be a link, and is made when missing."""
    fd = _open_root(root, create=create)
    try:
        for depth in range(len(parts)):
            child = _child(fd, parts, depth, path, create=create, made=made)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_root(root: Path, *, create: bool) -> int:
    if create:
        os.makedirs(root, exist_ok=True)
    return os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)


def _child(
    fd: int,
    parts: tuple[str, ...],
    depth: int,
    path: Path,
    *,
    create: bool,
    made: set[tuple[str, ...]] | None,
) -> int:
    """A descriptor of the directory ``parts[depth]`` inside ``fd`` (``root/parts[:depth]``),
    through no link; made when missing with ``create`` (noted in ``made``)."""
    part = parts[depth]
    try:
        return os.open(part, _DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise
        with suppress(FileExistsError):  # made by another writer meanwhile
            os.mkdir(part, 0o755, dir_fd=fd)
        # Noted either way: a directory another writer made is durable only once that writer
        # syncs its parent, and it may die first; the file written into it would then be lost
        # with the directory entry. One more fsync, only when two writers raced to make it.
        if made is not None:
            made.add(parts[:depth])
        return _open_dir(fd, part, path)
    except OSError as exc:
        if _is_link(fd, part) or exc.errno == errno.ELOOP:
            raise SymlinkRefused(str(path)) from None
        raise


class DirTree:
    """Directories below ``root``, each opened once and held until ``close``: what
    ``_walk`` does for one path, shared by many (a batch of blob files in a fan-out shares
    the root and often its first level). Same rules: no link followed (``SymlinkRefused``),
    missing directories made with ``create`` and noted in ``made``."""

    def __init__(
        self, root: Path, *, create: bool, made: set[tuple[str, ...]] | None = None
    ) -> None:
        self._root, self._create, self._made = Path(root), create, made
        self._fds: dict[tuple[str, ...], int] = {(): _open_root(root, create=create)}

    def parent_of(self, path: Path) -> tuple[int, str]:
        """(a descriptor of ``path``'s parent directory, the leaf name); the tree owns it."""
        parts = _parts(self._root, path)
        if not parts:
            raise InvalidArtifactPath(str(path), "is the artifact root itself")
        return self.directory(parts[:-1], path), parts[-1]

    def directory(self, parts: tuple[str, ...], path: Path) -> int:
        """A descriptor of ``root/parts`` (``path`` names it in errors); the tree owns it."""
        fd = self._fds.get(parts)
        if fd is None:
            parent = self.directory(parts[:-1], path)
            fd = _child(parent, parts, len(parts) - 1, path, create=self._create, made=self._made)
            self._fds[parts] = fd
        return fd

    def sync(self, made: set[tuple[str, ...]]) -> None:
        """fsync the directories ``made`` names (best effort, as ``sync_dirs``)."""
        for parts in sorted(made):
            _fsync_fd(self.directory(parts, self._root.joinpath(*parts)))

    def close(self) -> None:
        fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            with suppress(OSError):
                os.close(fd)

    def __enter__(self) -> DirTree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_dir(dir_fd: int, name: str, path: Path) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if _is_link(dir_fd, name) or exc.errno == errno.ELOOP:
            raise SymlinkRefused(str(path)) from None
        raise


@contextmanager
def parent_dir(
    root: Path, path: Path, *, create: bool = False, made: set[tuple[str, ...]] | None = None
) -> Iterator[tuple[int, str]]:
    """(a descriptor of ``path``'s parent directory, the leaf name), reached from ``root``
    without following any link; missing directories are made with ``create`` (noted in
    ``made``, see ``_walk``), otherwise FileNotFoundError. Act on the leaf with ``dir_fd=``
    calls only."""
    parts = _parts(root, path)
    if not parts:
        raise InvalidArtifactPath(str(path), "is the artifact root itself")
    fd = _walk(root, parts[:-1], path, create=create, made=made)
    try:
        yield fd, parts[-1]
    finally:
        os.close(fd)


def open_dir(root: Path, directory: Path) -> int | None:
    """A descriptor of the directory at ``directory`` (``root`` itself included), reached
    through no link; None when it does not exist. The caller closes it."""
    try:
        return _walk(root, _parts(root, directory), directory, create=False)
    except (FileNotFoundError, NotADirectoryError):
        return None


def sync_dirs(root: Path, made: set[tuple[str, ...]]) -> None:
    """fsync the directories ``made`` names (parts below ``root``), each reached through no
    link: a new directory is durable only once its parent is synced."""
    with DirTree(root, create=False) as tree:
        tree.sync(made)


def sync_dir(root: Path, directory: Path) -> None:
    """fsync ``directory`` (below ``root``, or ``root`` itself), reached through no link."""
    sync_dirs(root, {_parts(root, directory)})


def open_at(dir_fd: int, name: str, path: Path) -> int | None:
    """A read-only descriptor of the regular file ``name`` in ``dir_fd`` (``path`` names it
    in errors), never through a link (``SymlinkRefused``); None when there is no file."""
    try:
        fd = os.open(name, _LEAF_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if _is_link(dir_fd, name) or exc.errno == errno.ELOOP:
            raise SymlinkRefused(str(path)) from None
        raise
    return _regular(fd)


def lstat_at(dir_fd: int, name: str, path: Path) -> os.stat_result | None:
    """The entry ``name`` in ``dir_fd``, if a regular file; a link is ``SymlinkRefused``."""
    try:
        info = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        raise SymlinkRefused(str(path))
    return info if stat.S_ISREG(info.st_mode) else None


def makedirs(root: Path, path: Path) -> None:
    """``mkdir -p`` of ``path`` below ``root``, through no link."""
    os.close(_walk(root, _parts(root, path), path, create=True))


def exists(root: Path, path: Path, *, refuse_link: bool = False) -> bool:
    """Whether an entry (of any type, a link included) is at ``path``; its directories are
    reached through no link. With ``refuse_link``, a link at ``path`` is refused
    (``SymlinkRefused``) instead of counted: for callers that take "exists" as "done"."""
    try:
        with parent_dir(root, path) as (fd, name):
            mode = os.lstat(name, dir_fd=fd).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    if refuse_link and stat.S_ISLNK(mode):
        raise SymlinkRefused(str(path))
    return True


def unlink(root: Path, path: Path) -> None:
    """Remove the file at ``path``, if any, reached through no symlink. A link at the leaf
    is removed itself (unlink never touches a link's target)."""
    try:
        with parent_dir(root, path) as (fd, name):
            os.unlink(name, dir_fd=fd)
    except (FileNotFoundError, NotADirectoryError):
        pass


def rmdir(root: Path, path: Path) -> None:
    """Remove the empty directory at ``path``; OSError if it is not empty or absent."""
    with parent_dir(root, path) as (fd, name):
        os.rmdir(name, dir_fd=fd)


def rmtree(root: Path, path: Path) -> int:
    """Remove the directory tree at ``path`` (absent: nothing to do); the count of entries
    other than directories it removed (files, and any link or FIFO planted among them), in
    the one walk that removes them. Links inside it are removed, never followed: every
    directory is opened by descriptor with ``O_NOFOLLOW`` and its entries told apart by
    ``lstat`` type; a link, a FIFO or a file at ``path`` itself is refused, never opened. An
    entry that vanishes while the walk runs (another remover) is skipped, and not counted,
    and the walk goes on: it returns only once the whole tree is gone, and raises if any of
    it stays."""
    with ExitStack() as stack:
        try:
            fd, name = stack.enter_context(parent_dir(root, path))
            info = os.lstat(name, dir_fd=fd)
        except (FileNotFoundError, NotADirectoryError):
            return 0
        if stat.S_ISLNK(info.st_mode):
            raise SymlinkRefused(str(path))
        if not stat.S_ISDIR(info.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
        return _remove_dir(fd, name, path)


def _remove_dir(dir_fd: int, name: str, path: Path) -> int:
    """Remove the directory ``name`` at ``dir_fd`` with all in it: the count of entries
    other than directories removed (0 if another remover took it first). It is opened
    non-blocking with ``O_NOFOLLOW``: whatever was swapped in since it was seen as a
    directory, no open waits on it, and a link is ``SymlinkRefused``, never followed."""
    try:
        top = os.open(name, _DIR_FLAGS | _NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return 0
    except OSError as exc:
        if exc.errno == errno.ELOOP or _is_link(dir_fd, name):
            raise SymlinkRefused(str(path)) from None
        raise
    removed = 0
    try:
        with os.scandir(top) as listing:
            entries = [(e.name, _is_dir(e)) for e in listing]
        for entry, is_dir in entries:
            if is_dir:
                removed += _remove_dir(top, entry, path / entry)
                continue
            try:
                os.unlink(entry, dir_fd=top)
            except FileNotFoundError:
                continue
            removed += 1
    finally:
        os.close(top)
    with suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=dir_fd)
    return removed


def _is_dir(entry: os.DirEntry[str]) -> bool:
    """Whether the entry is a directory itself (a link to one is not); one that vanished
    before its type was read is not (its unlink then finds it gone)."""
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def merge_into(root: Path, source: Path, target: Path) -> int:
    """Move every entry of the directory ``source`` into the directory ``target`` (made if
    missing), then remove ``source``; how many entries other than directories moved. What
    both hold, ``source``'s replaces: a file the file, a directory merged into the
    directory, either kind the other kind. Links are moved as links, never followed, and
    none is walked through. An entry that vanishes meanwhile is skipped; ``source`` stays
    if something was made in it meanwhile."""
    src = open_dir(root, source)
    if src is None:
        return 0
    try:
        dst = _walk(root, _parts(root, target), target, create=True)
        try:
            moved = _merge_dir(src, dst, source, target)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    with suppress(OSError):  # not empty: a writer staged a file meanwhile
        rmdir(root, source)
    return moved


def _merge_dir(src: int, dst: int, source: Path, target: Path) -> int:
    moved = 0
    with os.scandir(src) as listing:
        entries = [(e.name, _is_dir(e)) for e in listing]
    for name, is_dir in entries:
        try:
            there = os.lstat(name, dir_fd=dst)
        except FileNotFoundError:
            there = None
        if is_dir and there is not None and stat.S_ISDIR(there.st_mode):
            moved += _merge_child(src, dst, name, source, target)
            continue
        if there is not None and (is_dir or stat.S_ISDIR(there.st_mode)):
            if stat.S_ISDIR(there.st_mode):  # no rename replaces a directory with a file
                _remove_dir(dst, name, target / name)
            else:
                os.unlink(name, dir_fd=dst)
        try:
            os.replace(name, name, src_dir_fd=src, dst_dir_fd=dst)
        except FileNotFoundError:
            continue
        moved += 1
    _fsync_fd(dst)
    _fsync_fd(src)
    return moved


def _merge_child(src: int, dst: int, name: str, source: Path, target: Path) -> int:
    child_src = _open_dir(src, name, source / name)
    try:
        child_dst = _open_dir(dst, name, target / name)
        try:
            moved = _merge_dir(child_src, child_dst, source / name, target / name)
        finally:
            os.close(child_dst)
    finally:
        os.close(child_src)
    with suppress(OSError):
        os.rmdir(name, dir_fd=src)
    return moved


def replace(root: Path, source: Path, target: Path, *, sync: bool = True) -> None:
    """Rename ``source`` onto ``target`` (replacing a file there; a link there is replaced,
    never followed), making ``target``'s directories as needed; fsyncs its directory."""
    with (
        parent_dir(root, source) as (src_fd, src_name),
        parent_dir(root, target, create=True) as (dst_fd, dst_name),
    ):
        os.replace(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        if sync:
            _fsync_fd(dst_fd)


def rename(root: Path, source: Path, target: Path) -> None:
    """Rename ``source`` (a directory, say) to ``target``, which must not exist as a
    non-empty directory; fsyncs both directories."""
    with (
        parent_dir(root, source) as (src_fd, src_name),
        parent_dir(root, target, create=True) as (dst_fd, dst_name),
    ):
        os.rename(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        _fsync_fd(dst_fd)
        _fsync_fd(src_fd)


def rename_new(root: Path, source: Path, target: Path) -> None:
    """Rename ``source`` to ``target``, never replacing anything there (FileExistsError,
    ``source`` left as it was), making ``target``'s directories as needed; fsyncs its
    directory. One atomic ``renameat2(RENAME_NOREPLACE)`` where the kernel, C library and
    filesystem have it; elsewhere a check then a rename, which a name made in between
    still loses to."""
    with (
        parent_dir(root, source) as (src_fd, src_name),
        parent_dir(root, target, create=True) as (dst_fd, dst_name),
    ):
        if not _rename_noreplace(src_fd, src_name, dst_fd, dst_name):
            if _exists_at(dst_fd, dst_name):
                raise FileExistsError(errno.EEXIST, "already exists", str(target))
            os.rename(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        _fsync_fd(dst_fd)


_RENAME_NOREPLACE = 1  # <linux/fs.h>
# renameat2 not there, or not for this filesystem: the caller checks, then renames
_NO_NOREPLACE = frozenset({errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})


def _load_renameat2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28 (or not Linux)
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p)
    function.argtypes += (ctypes.c_uint,)
    function.restype = ctypes.c_int
    return function


_renameat2 = _load_renameat2()


def _rename_noreplace(src_fd: int, src_name: str, dst_fd: int, dst_name: str) -> bool:
    """``renameat2(..., RENAME_NOREPLACE)``: True once renamed, FileExistsError when the
    name is taken, False where it is not supported (nothing done)."""
    if _renameat2 is None:
        return False
    source, target = os.fsencode(src_name), os.fsencode(dst_name)
    if _renameat2(src_fd, source, dst_fd, target, _RENAME_NOREPLACE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_NOREPLACE:
        return False
    raise OSError(code, os.strerror(code), dst_name)


def _exists_at(dir_fd: int, name: str) -> bool:
    try:
        os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def link(root: Path, source: Path, target: Path) -> None:
    """A new name ``target`` for ``source``'s inode (FileExistsError if taken); the link at
    ``source`` itself is never followed."""
    with (
        parent_dir(root, source) as (src_fd, src_name),
        parent_dir(root, target, create=True) as (dst_fd, dst_name),
    ):
        os.link(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd, follow_symlinks=False)


def write_new(root: Path, path: Path, data: bytes) -> None:
    """A new file at ``path`` holding ``data``, fsynced with its directory. A write or
    fsync that fails (a full disk) removes the file: a caller retrying would otherwise
    leave one partial file per attempt, until the staging sweep hours later."""
    with parent_dir(root, path, create=True) as (dir_fd, name):
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
        fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            # O_EXCL made it ours: no other writer's file is under this name.
            with suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
            raise
        finally:
            os.close(fd)
        _fsync_fd(dir_fd)


def _fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError:  # best effort: the change it makes durable was already made
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


def create_new(root: Path, path: Path) -> int:
    """A write descriptor of a new file at ``path``: never through a link, never onto an
    existing file; its directories are made as needed."""
    with parent_dir(root, path, create=True) as (dir_fd, name):
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
        return os.open(name, flags, 0o644, dir_fd=dir_fd)
