"""Blobs as files: ``<root>/<h[0:2]>/<h[2:4]>/<hash>.blob[.gz]``, written durably
(temporary file, fsync, rename, directory fsync)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from core.blobs.store import (
    CORRUPT_DIR,
    DEFAULT_GZIP_LEVEL,
    QUARANTINE_SUFFIX,
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
from core.fsio import fsync_dir, replace_many_atomically
from core.models import utcnow

log = logging.getLogger(__name__)


class FileBlobStore(BlobStore):
    def __init__(
        self, root: Path, index: BlobIndex, *, gzip_level: int = DEFAULT_GZIP_LEVEL
    ) -> None:
        super().__init__(index, gzip_level=gzip_level)
        self.root = Path(root)
        self._root = os.fspath(self.root)

    def path_for(self, blob_hash: str, codec: Codec) -> Path:
        return Path(self._fspath(blob_hash, codec))

    def _fspath(self, blob_hash: str, codec: Codec) -> str:
        """The one place a hash becomes a path; it validates first (invariant 9)."""
        check_hash(blob_hash)
        name = blob_hash + SUFFIXES[codec]
        return os.path.join(self._root, blob_hash[0:2], blob_hash[2:4], name)

    def _find(self, blob_hash: str, first: Codec | None = None) -> tuple[Codec, int] | None:
        for codec in SUFFIXES:  # a stat per codec costs microseconds: no need for ``first``
            try:
                return codec, os.stat(self._fspath(blob_hash, codec)).st_size
            except FileNotFoundError:
                continue
        return None

    def _read(self, blob_hash: str) -> tuple[Codec, bytes] | None:
        found = self._read_stored(blob_hash)
        if found is None and self._unquarantine(blob_hash):
            # A GC died between moving this file aside and deleting its row: put it back.
            # (Should that GC still commit, the file is merely an orphan, swept later.)
            found = self._read_stored(blob_hash)
        return found

    def _read_stored(self, blob_hash: str) -> tuple[Codec, bytes] | None:
        for codec in SUFFIXES:
            try:
                with open(self._fspath(blob_hash, codec), "rb") as handle:
                    return codec, handle.read()
            except FileNotFoundError:
                continue
        return None

    def quarantine_file(self, blob_hash: str) -> list[Path]:
        moved: list[Path] = []
        for codec in SUFFIXES:
            aside = self._aside(blob_hash, codec)
            try:
                os.replace(self.path_for(blob_hash, codec), aside)
            except FileNotFoundError:
                continue
            moved.append(aside)
        return moved

    def purge_quarantined(self, moved: Sequence[Path]) -> None:
        for path in moved:
            path.unlink(missing_ok=True)
        for directory in {path.parent for path in moved}:
            fsync_dir(directory)

    def restore_quarantined(self, moved: Sequence[Path]) -> None:
        for path in moved:
            with contextlib.suppress(FileNotFoundError):
                os.replace(path, path.with_name(path.name[: -len(QUARANTINE_SUFFIX)]))

    def _aside(self, blob_hash: str, codec: Codec) -> Path:
        path = self.path_for(blob_hash, codec)
        return path.with_name(path.name + QUARANTINE_SUFFIX)

    def _unquarantine(self, blob_hash: str) -> bool:
        moved = [p for p in (self._aside(blob_hash, c) for c in SUFFIXES) if p.exists()]
        self.restore_quarantined(moved)
        return bool(moved)

    def iter_quarantined(self) -> Iterator[tuple[str, Path]]:
        if not self.root.is_dir():
            return
        for path in self.root.glob(f"??/??/*{QUARANTINE_SUFFIX}"):
            parsed = parse_blob_name(path.name[: -len(QUARANTINE_SUFFIX)])
            if parsed is not None:
                yield parsed[0], path

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

    def _write_all(self, files: dict[str, tuple[Codec, bytes]]) -> None:
        """Write blob files durably and atomically, synced together (one pass of fsyncs)."""
        if not files:
            return
        items = [(self.path_for(h, codec), payload) for h, (codec, payload) in files.items()]
        created = [d for path, _ in items for d in _make_dirs(self.root, path.parent)]
        replace_many_atomically(items)
        # A new fan-out directory is durable only once its own parent is synced.
        for directory in dict.fromkeys(d.parent for d in created):
            fsync_dir(directory)
        for blob_hash, (codec, payload) in files.items():
            log.debug(
                "blob written",
                extra={"blob_hash": blob_hash, "codec": codec, "bytes": len(payload)},
            )

    def remove_file(self, blob_hash: str) -> bool:
        removed = False
        for codec in SUFFIXES:
            path = self.path_for(blob_hash, codec)
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            removed = True
            fsync_dir(path.parent)
        return removed

    def iter_files(self) -> Iterator[BlobFile]:
        for leaf in fanout_dirs(self.root):
            yield from _blob_files(leaf)

    def _discard_other_codecs(self, blob_hash: str, keep: Codec) -> None:
        for codec in SUFFIXES:
            if codec == keep:
                continue
            path = self.path_for(blob_hash, codec)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                fsync_dir(path.parent)

    def quarantine_corrupt(self, blob_hash: str) -> list[str]:
        # Outside the two-character fan-out directories, so no scan ever takes it for a blob.
        target = self.root / CORRUPT_DIR
        target.mkdir(parents=True, exist_ok=True)
        stamp = utcnow().strftime("%Y%m%dT%H%M%S%f")
        moved: list[str] = []
        for codec in SUFFIXES:
            path = self.path_for(blob_hash, codec)
            aside = target / f"{path.name}.{stamp}"
            try:
                os.replace(path, aside)
            except FileNotFoundError:
                continue
            fsync_dir(path.parent)
            moved.append(os.fspath(aside))
        if moved:
            fsync_dir(target)
        return moved


def _make_dirs(root: Path, directory: Path) -> list[Path]:
    """Create ``directory`` (under ``root``); return the directories this call created."""
    created: list[Path] = []
    for candidate in [root, directory.parent, directory]:
        try:
            candidate.mkdir(parents=True)
            created.append(candidate)
        except FileExistsError:
            pass
    return created


def fanout_dirs(root: Path | str) -> Iterator[str]:
    """The leaf directories of the two fan-out levels (``<h[0:2]>/<h[2:4]>``) under ``root``."""
    for first in _subdirs(root):
        yield from _subdirs(first)


def _subdirs(directory: Path | str) -> list[str]:
    try:
        with os.scandir(directory) as entries:
            return sorted(
                e.path for e in entries if len(e.name) == 2 and e.is_dir(follow_symlinks=False)
            )
    except (FileNotFoundError, NotADirectoryError):
        return []


def _blob_files(directory: str) -> Iterator[BlobFile]:
    with os.scandir(directory) as entries:
        for entry in entries:
            parsed = parse_blob_name(entry.name)
            if parsed is None or not entry.is_file(follow_symlinks=False):
                continue
            stat = entry.stat(follow_symlinks=False)
            yield BlobFile(parsed[0], parsed[1], Path(entry.path), stat.st_size, stat.st_mtime)
