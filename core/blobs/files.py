"""Blobs as files: ``<root>/<h[0:2]>/<h[2:4]>/<hash>.blob[.gz]``, written durably
(temporary file, fsync, rename, directory fsync).

No symlink below the root is followed (invariant 9): every read, write, move and delete
acts relative to a descriptor of the fan-out directory, reached through ``core.nofollow``;
a link is ``SymlinkRefused``.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from core import nofollow
from core.blobs.store import (
    CORRUPT_DIR,
    DEFAULT_GZIP_LEVEL,
    QUARANTINE_SUFFIX,
    STREAM_CHUNK,
    SUFFIXES,
    BlobFile,
    BlobIndex,
    BlobStore,
    Codec,
    _Stored,
    check_hash,
    encode_blob,
    parse_blob_name,
)
from core.errors import BlobLinked, SymlinkRefused
from core.fsio import fsync_dir, path_text, replace_many_atomically
from core.translate import storage_errors

log = logging.getLogger(__name__)


class FileBlobStore(BlobStore):
    def __init__(
        self, root: Path, index: BlobIndex, *, gzip_level: int = DEFAULT_GZIP_LEVEL
    ) -> None:
        super().__init__(index, gzip_level=gzip_level)
        self.root = Path(root)
        self._root = os.fspath(self.root)
        self._root_made = False

    def path_for(self, blob_hash: str, codec: Codec) -> Path:
        return Path(self._fspath(blob_hash, codec))

    def _fspath(self, blob_hash: str, codec: Codec) -> str:
        """The one place a hash becomes a path; it validates first (invariant 9)."""
        check_hash(blob_hash)
        name = blob_hash + SUFFIXES[codec]
        return os.path.join(self._root, blob_hash[0:2], blob_hash[2:4], name)

    @contextmanager
    def _fanout(self, blob_hash: str) -> Iterator[int | None]:
        """A descriptor of the hash's fan-out directory (reached through no link), or None
        when it does not exist."""
        check_hash(blob_hash)
        fd = nofollow.open_dir(self.root, self.root / blob_hash[0:2] / blob_hash[2:4])
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def _present(self, fd: int, blob_hash: str) -> dict[Codec, int]:
        """Stored size by codec of the hash's files in its fan-out directory ``fd``."""
        sizes: dict[Codec, int] = {}
        for codec, suffix in SUFFIXES.items():
            info = _entry_at(fd, blob_hash + suffix)
            if info is not None:
                sizes[codec] = info.st_size
        return sizes

    def _ordered(self, blob_hash: str, present: list[Codec], first: Codec | None) -> list[Codec]:
        """The stored codecs, the one to serve first: with two files (a damaged leftover
        beside a good copy, say), ``first`` or else the registered codec."""
        if len(present) < 2:
            return present
        wanted = first or self.index.codec_of(blob_hash)
        return sorted(present, key=lambda codec: codec != wanted)

    @storage_errors("blobs")
    def _find(self, blob_hash: str, first: Codec | None = None) -> tuple[Codec, int] | None:
        found = self._find_stored(blob_hash, first)
        if found is None and self._unquarantine(blob_hash):
            found = self._find_stored(blob_hash, first)  # as ``_read`` does
        return found

    def _find_stored(self, blob_hash: str, first: Codec | None) -> tuple[Codec, int] | None:
        with self._fanout(blob_hash) as fd:
            if fd is None:
                return None
            sizes = self._present(fd, blob_hash)
        codecs = self._ordered(blob_hash, list(sizes), first)
        return (codecs[0], sizes[codecs[0]]) if codecs else None

    @storage_errors("blobs")
    def _read(self, blob_hash: str) -> tuple[Codec, bytes] | None:
        found = self._read_stored(blob_hash)
        if found is None and self._unquarantine(blob_hash):
            # A GC died between moving this file aside and deleting its row: put it back.
            # (Should that GC still commit, the file is merely an orphan, swept later.)
            found = self._read_stored(blob_hash)
        return found

    def _read_stored(self, blob_hash: str) -> tuple[Codec, bytes] | None:
        opened = self._open_stored(blob_hash)
        if opened is None:
            return None
        codec, handle = opened
        with handle:
            return codec, handle.read()

    def _read_at(self, fd: int, blob_hash: str, codec: Codec) -> bytes | None:
        file_fd = self._open_at(fd, blob_hash, codec)
        if file_fd is None:
            return None
        with os.fdopen(file_fd, "rb") as handle:
            return handle.read()

    def _open_at(self, fd: int, blob_hash: str, codec: Codec) -> int | None:
        """A descriptor of the blob's file under ``codec``, or None. A link in its place
        (planted, or left by a restore that kept links) is a damaged copy: ``BlobLinked``, a
        ``BlobCorrupted`` readers report and keep the ref for, and which a put of the content
        repairs (the new file is renamed over the link itself), as it repairs any damaged
        file (invariant 13); ``blobs verify`` reports it as a link. Never followed."""
        path = self.path_for(blob_hash, codec)
        try:
            return nofollow.open_at(fd, path.name, path)
        except SymlinkRefused:
            raise BlobLinked(blob_hash, str(path)) from None

    @contextmanager
    def _open(self, blob_hash: str) -> Iterator[tuple[Codec, Iterator[bytes]] | None]:
        with storage_errors("blobs"):
            opened = self._open_stored(blob_hash)
            if opened is None and self._unquarantine(blob_hash):  # as ``_read`` does
                opened = self._open_stored(blob_hash)
        if opened is None:
            yield None
            return
        codec, handle = opened
        with handle:
            yield codec, _chunks(handle)

    def _open_stored(self, blob_hash: str) -> tuple[Codec, BinaryIO] | None:
        """The first stored file that opens, the registered codec's first (through no link;
        a link in a file's place is skipped for another copy, else ``BlobLinked``)."""
        linked: BlobLinked | None = None
        with self._fanout(blob_hash) as fd:
            if fd is None:
                return None
            for codec in self._ordered(blob_hash, list(self._present(fd, blob_hash)), None):
                try:
                    file_fd = self._open_at(fd, blob_hash, codec)
                except BlobLinked as exc:  # a link in its place: another copy may serve
                    linked = exc
                    continue
                if file_fd is not None:
                    return codec, os.fdopen(file_fd, "rb")
        if linked is not None:
            raise linked
        return None

    @storage_errors("blobs")
    def _read_codec(self, blob_hash: str, codec: Codec) -> bytes | None:
        with self._fanout(blob_hash) as fd:
            return None if fd is None else self._read_at(fd, blob_hash, codec)

    @storage_errors("blobs")
    def quarantine_file(self, blob_hash: str) -> list[Path]:
        moved: list[Path] = []
        with self._fanout(blob_hash) as fd:
            if fd is None:
                return moved
            for codec in SUFFIXES:
                path = self.path_for(blob_hash, codec)
                if _entry_at(fd, path.name) is None:  # a link moves aside too, unfollowed
                    continue
                aside = self._aside(blob_hash, codec)
                try:
                    os.replace(path.name, aside.name, src_dir_fd=fd, dst_dir_fd=fd)
                except FileNotFoundError:
                    continue
                moved.append(aside)
        return moved

    @storage_errors("blobs")
    def purge_quarantined(self, moved: Sequence[Path]) -> None:
        for path in moved:
            nofollow.unlink(self.root, path)
        for directory in {path.parent for path in moved}:
            nofollow.sync_dir(self.root, directory)

    @storage_errors("blobs")
    def restore_quarantined(self, moved: Sequence[Path]) -> None:
        for path in moved:
            original = path.with_name(path.name[: -len(QUARANTINE_SUFFIX)])
            try:
                nofollow.replace(self.root, path, original, sync=False)
            except FileNotFoundError:
                continue

    def _aside(self, blob_hash: str, codec: Codec) -> Path:
        path = self.path_for(blob_hash, codec)
        return path.with_name(path.name + QUARANTINE_SUFFIX)

    def _unquarantine(self, blob_hash: str) -> bool:
        with self._fanout(blob_hash) as fd:
            if fd is None:
                return False
            moved = [
                aside
                for aside in (self._aside(blob_hash, c) for c in SUFFIXES)
                if _entry_at(fd, aside.name) is not None
            ]
        self.restore_quarantined(moved)
        return bool(moved)

    def iter_quarantined(self) -> Iterator[tuple[str, Path]]:
        for leaf in fanout_dirs(self.root):
            for entry in _entries(leaf):
                if not entry.name.endswith(QUARANTINE_SUFFIX):
                    continue
                parsed = parse_blob_name(entry.name[: -len(QUARANTINE_SUFFIX)])
                if parsed is not None and entry.is_file(follow_symlinks=False):
                    yield parsed[0], Path(entry.path)

    def _write(self, blob_hash: str, codec: Codec, payload: bytes) -> None:
        self._write_all({blob_hash: (codec, payload)})

    def _stage_all(self, unique: dict[str, bytes]) -> dict[str, _Stored]:
        """As the base, but the new files are written and synced together."""
        staged: dict[str, _Stored] = {}
        new: dict[str, tuple[Codec, bytes]] = {}
        for blob_hash, data in unique.items():
            kept = self._kept(blob_hash, data)
            if kept is not None:
                staged[blob_hash] = kept
            else:
                new[blob_hash] = encode_blob(data, level=self.gzip_level)
        self._write_all(new)
        for blob_hash, (codec, payload) in new.items():
            self.digests.record(blob_hash, codec, payload, len(unique[blob_hash]))
            self._discard_other_codecs(blob_hash, codec)
            staged[blob_hash] = _Stored(codec, len(payload), payload, written=True)
        return staged

    @storage_errors("blobs")
    def _write_all(self, files: dict[str, tuple[Codec, bytes]]) -> None:
        """Write blob files durably and atomically, synced together (one pass of fsyncs),
        never through a link below the root (``SymlinkRefused``)."""
        if not files:
            return
        new_root = self._make_root()
        items = [(self.path_for(h, codec), payload) for h, (codec, payload) in files.items()]
        replace_many_atomically(items, root=self.root)
        if new_root:
            fsync_dir(self.root.parent)
        for blob_hash, (codec, payload) in files.items():
            log.debug(
                "blob written",
                extra={"blob_hash": blob_hash, "codec": codec, "bytes": len(payload)},
            )

    def _make_root(self) -> bool:
        """Make the root if missing (checked once); whether this call made it. Each write
        makes the fan-out directories it needs."""
        if self._root_made:
            return False
        self._root_made = True
        try:
            self.root.mkdir(parents=True)
        except FileExistsError:
            return False
        return True

    @storage_errors("blobs")
    def remove_file(self, blob_hash: str) -> bool:
        return bool(self._unlink(blob_hash, SUFFIXES))

    def _unlink(self, blob_hash: str, codecs: Iterable[Codec]) -> list[Codec]:
        """Remove the hash's files under ``codecs`` (a link there is removed itself, never
        followed); the codecs removed."""
        removed: list[Codec] = []
        with self._fanout(blob_hash) as fd:
            if fd is None:
                return removed
            for codec in codecs:
                try:
                    os.unlink(blob_hash + SUFFIXES[codec], dir_fd=fd)
                except FileNotFoundError:
                    continue
                removed.append(codec)
            if removed:
                os.fsync(fd)
        return removed

    def iter_files(self, after: str = "") -> Iterator[BlobFile]:
        for _, entry in fanout_entries(self.root, after):
            parsed = parse_blob_name(entry.name)
            if parsed is None or not entry.is_file(follow_symlinks=False):
                continue
            stat = entry.stat(follow_symlinks=False)
            yield BlobFile(parsed[0], parsed[1], Path(entry.path), stat.st_size, stat.st_mtime)

    @storage_errors("blobs")
    def _discard_other_codecs(self, blob_hash: str, keep: Codec) -> None:
        self._unlink(blob_hash, (codec for codec in SUFFIXES if codec != keep))

    @storage_errors("blobs")
    def _move_corrupt(self, blob_hash: str, codec: Codec, stamp: str) -> str | None:
        # Outside the two-character fan-out directories, so no scan ever takes it for a blob.
        path = self.path_for(blob_hash, codec)
        aside = self.root / CORRUPT_DIR / f"{path.name}.{stamp}"
        try:
            nofollow.replace(self.root, path, aside)
        except FileNotFoundError:
            return None
        nofollow.sync_dir(self.root, path.parent)
        return os.fspath(aside)


def _entry_at(dir_fd: int, name: str) -> os.stat_result | None:
    """The regular file or symlink ``name`` in ``dir_fd`` (its own lstat), else None."""
    try:
        info = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    return info if stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode) else None


def _chunks(handle: BinaryIO) -> Iterator[bytes]:
    """A file's bytes, ``STREAM_CHUNK`` at a time (a read error typed, as ``_read``'s)."""
    while True:
        with storage_errors("blobs"):
            chunk = handle.read(STREAM_CHUNK)
        if not chunk:
            return
        yield chunk


def fanout_dirs(root: Path | str) -> Iterator[str]:
    """The leaf directories of the two fan-out levels (``<h[0:2]>/<h[2:4]>``) under ``root``."""
    for first in _subdirs(root):
        yield from _subdirs(first)


def fanout_entries(root: Path | str, after: str = "") -> Iterator[tuple[str, os.DirEntry[str]]]:
    """(key, entry) of each entry of the fan-out leaves, in key order, those past ``after``.

    A key is ``<h[0:2]>/<h[2:4]>/<name>``, as an object store names the same blob, and the
    order is the one it lists keys in: a walk cut short goes on from its last key.
    """
    leaf_after = after[:5]
    for first in _subdirs(root):
        top = os.path.basename(first)
        if top < leaf_after[:2] or not _is_hex2(top):  # (no blob lives elsewhere)
            continue
        for leaf in _subdirs(first):
            prefix = f"{top}/{os.path.basename(leaf)}"
            if prefix < leaf_after or not _is_hex2(prefix[3:]):
                continue
            # a name that is not UTF-8 as \xff: the key is stored as JSON (a GC's resume)
            keyed = [(path_text(f"{prefix}/{e.name}"), e) for e in _entries(leaf)]
            keyed.sort(key=lambda pair: pair[0])
            for key, entry in keyed:
                if key > after:
                    yield key, entry


def _is_hex2(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def _subdirs(directory: Path | str) -> list[str]:
    try:
        with os.scandir(directory) as entries:
            return sorted(
                e.path for e in entries if len(e.name) == 2 and e.is_dir(follow_symlinks=False)
            )
    except (FileNotFoundError, NotADirectoryError):
        return []


def _entries(directory: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except (FileNotFoundError, NotADirectoryError):
        return []
