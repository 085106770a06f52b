"""Durable file mechanics, written once: fsync a directory, write a file durably, and
replace a file atomically (temporary file, fsync, rename, directory fsync).

Blobs, artifacts and the embedded queue's lock files all write through these.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, AnyStr

from core import nofollow
from core.exact_json import LONE_SURROGATE, escape_lone_surrogates


def path_text(path: str | os.PathLike[str]) -> str:
    """A file name as text every backend stores and every terminal shows: a byte that is
    not UTF-8 (``os.fsdecode`` keeps it as U+DC80-U+DCFF) as ``\\xff``, any other lone
    surrogate as ``\\ud800``; a UTF-8 name unchanged. One name one text, so a stored name
    matches itself; a name spelled with a literal ``\\xff`` shares its text."""
    return LONE_SURROGATE.sub(_surrogate_escape, os.fspath(path))


# Marks a key that ``key_text`` escaped (U+FEFF: no pi or Claude Code id begins with one).
ESCAPED_KEY = "\ufeff"


def key_text(value: str) -> str:
    """An id as the text the database matches it by, one text per id: unchanged when it is
    storable text, else (a lone surrogate in it) ``ESCAPED_KEY`` then the id with every
    backslash doubled and every lone surrogate as ``\\udxxx``. ``path_text`` alone made
    ``"p\\ud800"`` (a backslash, then "ud800") and ``"p"`` + U+D800 one text, so two
    sessions shared one key; an id that begins with ``ESCAPED_KEY`` is escaped too, so no
    other id can spell an escaped one."""
    if not LONE_SURROGATE.search(value) and not value.startswith(ESCAPED_KEY):
        return value
    return ESCAPED_KEY + escape_lone_surrogates(value.replace("\\", "\\\\"))


def _surrogate_escape(match: re.Match[str]) -> str:
    code = ord(match[0])
    return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"


def yet_to_make(directory: Path, what: str) -> str | None:
    """For a health check that makes nothing: None when ``directory`` is there (probe it);
    else the line saying it is not there yet and can be made, in the nearest directory
    above it that is (``OSError`` if that one cannot be written to, or is no directory)."""
    if os.path.lexists(directory):
        return None
    above = directory.parent
    while not os.path.lexists(above) and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(above))
    if not os.access(above, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "cannot be written to", str(above))
    return f"{what} {directory} is not there yet: it can be made in {above}"


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


@contextlib.contextmanager
def published_text(path: Path) -> Iterator[IO[str]]:
    """A text file written in a stream and published whole at ``path``: a new file beside it
    (a name of its own, never an existing file or link), fsynced, renamed over ``path``, the
    directory fsynced. A reader of ``path`` (an agent with the session open, a watcher) sees
    the old file or the whole new one, a crash leaves one or the other, and a failure while
    writing removes the new file. Made as ``open()`` makes a file (0666 less the umask);
    text is UTF-8, a lone surrogate passed through (it is what the stored value holds).

    A path that is no regular file (a FIFO, a device, a link such as ``/dev/stdout``) is
    written in place, as a shell's ``>`` would: renaming over it replaced the device, pipe
    or link with a file, and the text never reached its reader. A step of its own that
    fails (no such directory, no permission, a full disk at the fsync) is ``UnwritableFile``
    naming ``path``, not the new file beside it."""
    with _published(path, _text_writer) as out:
        yield out


@contextlib.contextmanager
def published_bytes(path: Path) -> Iterator[IO[bytes]]:
    """``published_text`` for bytes (an export streamed as it was stored)."""
    with _published(path, _bytes_writer) as out:
        yield out


@contextlib.contextmanager
def _published(path: Path, writer: Callable[[int | Path], IO[AnyStr]]) -> Iterator[IO[AnyStr]]:
    given = path  # a failure names it, never the temporary file beside it
    descriptor = _descriptor_named(path)
    if descriptor is not None:  # /dev/stdout, /dev/fd/N: this process's own descriptor
        with _unwritable(given):
            shared = writer(os.dup(descriptor))
        with shared:
            yield shared
        return
    target, existing = _file_to_replace(path)
    if target is None:
        with _unwritable(given):
            direct = writer(path)
        with direct:
            yield direct
        return
    path = target
    with _unwritable(given):
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with _unwritable(given):
            _take_mode(fd, existing)
        with writer(fd) as out:
            yield out
            with _unwritable(given):
                out.flush()
                os.fsync(out.fileno())
        with _unwritable(given):
            os.replace(name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
        raise
    fsync_dir(path.parent, strict=False)


@contextlib.contextmanager
def _unwritable(path: Path) -> Iterator[None]:
    """An ``OSError`` of ``published_text``'s own steps (not of what its caller writes) as
    ``UnwritableFile`` naming ``path`` as the caller gave it."""
    try:
        yield
    except OSError as exc:
        from core.errors import UnwritableFile

        raise UnwritableFile(str(path), exc.strerror or str(exc)) from exc


def _text_writer(file: int | Path) -> IO[str]:
    """The text ``published_text`` writes: UTF-8, a lone surrogate passed through, ``\n``."""
    return open(file, "w", encoding="utf-8", errors="surrogatepass", newline="\n")


def _bytes_writer(file: int | Path) -> IO[bytes]:
    return open(file, "wb")


_OWN_DESCRIPTOR = re.compile(r"/(?:proc/(?:self|(?P<pid>[0-9]+))|dev)/fd/(?P<fd>[0-9]+)")


def _descriptor_named(path: Path) -> int | None:
    """The descriptor of this process a path names through links (``/dev/stdout`` ->
    ``/proc/self/fd/1``), else None. Written through that descriptor, a ``>> log`` keeps
    what it holds and what comes after; opened again by name, the file was truncated (or
    renamed over), and an earlier line of the log lost."""
    current = Path(os.path.abspath(path))
    for _ in range(40):  # the kernel's own limit on a chain of links
        found = _OWN_DESCRIPTOR.fullmatch(str(current))
        if found is not None and found["pid"] in (None, str(os.getpid())):
            return int(found["fd"])
        if not current.is_symlink():
            return None
        current = Path(os.path.abspath(current.parent / os.readlink(current)))
    return None


def _file_to_replace(path: Path) -> tuple[Path | None, os.stat_result | None]:
    """Where ``published_text`` puts its new file, and the file it replaces: ``path`` when
    it is a regular file or nothing yet; None (write in place) for anything else. A link is
    written through, never resolved by name: ``/dev/stdout`` names /proc/self/fd/1, whose
    target's name may be a file that other writes share (``>> log``), and a rename over it
    replaced that file."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return path, None
    return (path, info) if stat.S_ISREG(info.st_mode) else (None, None)


def _take_mode(fd: int, existing: os.stat_result | None) -> None:
    """The new file's permissions (mkstemp's are 0600): those of the file it replaces, as a
    shell's ``>`` keeps them (a private file stays private), with its owner and group where
    this process may set them; else a new file's (0666 less the umask). The mode is set
    first, while the file is this process's: given away, it may not be set again (root
    without CAP_FOWNER), and a change of owner may clear set-id bits."""
    if existing is None:
        mask = os.umask(0)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)
        return
    mode = stat.S_IMODE(existing.st_mode)
    os.fchmod(fd, mode)
    if (existing.st_uid, existing.st_gid) == (os.geteuid(), os.getegid()):
        return
    try:  # only root gives a file away; an owner a user namespace cannot map is EINVAL
        os.fchown(fd, existing.st_uid, existing.st_gid)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.fchmod(fd, mode)


def replace_atomically(path: Path, data: bytes, *, prefix: str = ".tmp-") -> None:
    """Put ``data`` at ``path``: readers see the old content or the whole new one, and
    after a crash the file is one or the other. The directory must exist."""
    replace_many_atomically([(path, data)], prefix=prefix)


#: Files one pass of ``replace_many_atomically`` holds open: a temporary file each, plus
#: their directories. A batch of a thousand screenshots would otherwise need thousands of
#: descriptors, past the usual soft limit of 1,024 (EMFILE).
FILES_PER_PASS = 128


def replace_many_atomically(
    items: Sequence[tuple[Path, bytes]], *, prefix: str = ".tmp-", root: Path | None = None
) -> None:
    """``replace_atomically`` for several files, synced together: every temporary file is
    written, then each is fsynced (after the first, ext4 has usually committed the rest
    with it), then renamed, then each directory is fsynced once. A file is renamed only
    after its own fsync returned, so a crash never exposes a partial one. Files go in
    passes of ``FILES_PER_PASS``, which bounds the descriptors held at once.

    Each step acts relative to a descriptor of the file's directory. With ``root`` that
    descriptor is reached through no symlink below ``root`` (``core.nofollow``:
    ``SymlinkRefused``), each directory opened once per pass, missing ones made, and new
    ones synced into their parents; without it the directories must exist."""
    for start in range(0, len(items), FILES_PER_PASS):
        _replace_pass(items[start : start + FILES_PER_PASS], prefix, root)


def _replace_pass(items: Sequence[tuple[Path, bytes]], prefix: str, root: Path | None) -> None:
    if root is None:
        with contextlib.ExitStack() as stack:
            dirs: dict[Path, int] = {}
            for path, _ in items:
                if path.parent not in dirs:
                    dirs[path.parent] = stack.enter_context(_open_directory(path.parent))
            _write_renamed([(dirs[path.parent], path.name, data) for path, data in items], prefix)
            for fd in dirs.values():
                os.fsync(fd)
        return
    made: set[tuple[str, ...]] = set()
    with nofollow.DirTree(root, create=True, made=made) as tree:
        entries = [(*tree.parent_of(path), data) for path, data in items]
        _write_renamed(entries, prefix)
        for fd in dict.fromkeys(fd for fd, _, _ in entries):
            os.fsync(fd)
        tree.sync(made)  # new directories are durable once their parents are synced


@contextlib.contextmanager
def _open_directory(directory: Path) -> Iterator[int]:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        yield fd
    finally:
        os.close(fd)


def _write_renamed(entries: Sequence[tuple[int, str, bytes]], prefix: str) -> None:
    """Write each (directory descriptor, name, data) to a temporary file beside its name,
    fsync them all, then rename each onto its name; nothing is left on failure."""
    fds: list[int] = []
    temps: list[tuple[int, str, str]] = []
    try:
        try:
            for dir_fd, name, data in entries:
                tmp, fd = _create_temp(dir_fd, prefix)
                fds.append(fd)
                temps.append((dir_fd, tmp, name))
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            for fd in fds:
                os.fsync(fd)
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        for dir_fd, tmp, name in temps:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        for dir_fd, tmp, _ in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
        raise


_TEMP_FLAGS = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


def _create_temp(dir_fd: int, prefix: str) -> tuple[str, int]:
    """A new private file ``<prefix><random>.part`` in ``dir_fd``, as ``mkstemp`` makes."""
    for _ in range(100):
        name = f"{prefix}{secrets.token_hex(6)}.part"
        try:
            return name, os.open(name, _TEMP_FLAGS, 0o600, dir_fd=dir_fd)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name", prefix)
