"""``blobs verify``: check every registered blob against its hash (invariant 13).

The registry is walked in hash order, a page at a time. Each blob is either fine, missing
(registered, no file) or corrupt (its content does not hash to its name). Corrupt files are
moved to the store's ``corrupt/`` directory, never served again. A symlink at a blob's file,
in its directories or at ``corrupt/`` is never followed: it is reported (``symlinks``, each
refused path once) and the run goes on with the other blobs. With ``repair_from``, a
missing or corrupt blob is re-written from a directory of known-good blobs: files named like
the store's own (``<hash>.blob.gz`` / ``<hash>.blob``, or as ``corrupt/`` names them, with a
time stamp after) or by the bare hash (raw bytes), at any depth. Files on disk that no row
registers are reported (blob GC sweeps them). Corrupt files are moved under the blob row's
lock, after a check under it: a file a concurrent put has just repaired stays.
"""

from __future__ import annotations

import logging
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from core import nofollow
from core.blobs.files import FileBlobStore
from core.blobs.store import (
    BlobStore,
    Codec,
    decode_blob,
    is_valid_hash,
    parse_blob_name,
    sha256_hex,
)
from core.db import read_connection
from core.errors import SymlinkRefused
from core.maintenance.runs import Progress
from core.models import BlobRow, table_of

log = logging.getLogger(__name__)

_blobs = table_of(BlobRow)
PAGE = 500
MAX_LISTED = 1000  # hashes listed per category in a report; the counts are always exact


@dataclass(slots=True)
class VerifyReport:
    checked: int = 0
    ok: int = 0
    missing: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    unregistered: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)  # where corrupt files went
    repaired: list[str] = field(default_factory=list)
    unrepaired: list[str] = field(default_factory=list)  # "<hash>: why", a good copy at hand
    symlinks: list[str] = field(default_factory=list)  # refused paths, each once
    counts: dict[str, int] = field(default_factory=dict)
    _links_seen: set[str] = field(default_factory=set)

    def note(self, kind: str, value: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        listed: list[str] = getattr(self, kind)
        if len(listed) < MAX_LISTED:
            listed.append(value)

    def note_symlink(self, blob_hash: str, path: str, root: Path | None = None) -> None:
        """A link refused on the way to ``blob_hash``'s files, reported once under its own
        path (a linked directory is met once per blob below it; the refusal names the path
        asked for, below ``root``, and the link is looked for on the way there)."""
        link = nofollow.first_link(root, Path(path)) if root is not None else None
        path = str(link) if link is not None else path
        log.error("blob verify refused a symlink", extra={"blob_hash": blob_hash, "path": path})
        if path not in self._links_seen:
            self._links_seen.add(path)
            self.note("symlinks", path)

    @property
    def healthy(self) -> bool:
        """Nothing is left missing or corrupt (repaired blobs count as healthy), and no
        symlink stands under the blob root."""
        broken = self.counts.get("missing", 0) + self.counts.get("corrupt", 0)
        return broken == self.counts.get("repaired", 0) and not self.counts.get("symlinks")

    def to_dict(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "ok": self.ok,
            **{f"{k}_count": self.counts.get(k, 0) for k in _KINDS},
            **{k: getattr(self, k) for k in _KINDS},
            "healthy": self.healthy,
        }


_KINDS = (
    "missing",
    "corrupt",
    "unregistered",
    "quarantined",
    "repaired",
    "unrepaired",
    "symlinks",
)


class KnownGood:
    """An index of a directory of known-good blobs, by hash (read lazily, verified on use)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.files: dict[str, list[tuple[Path, Codec]]] = {}
        for directory, _dirs, names in os.walk(root):  # os.walk does not follow symlinks
            for name in names:
                parsed = parse_blob_name(name, stamped=True)  # corrupt/ holds stamped names
                if parsed is None and is_valid_hash(name):
                    parsed = (name, "identity")
                if parsed is not None:
                    path = Path(directory, name)
                    self.files.setdefault(parsed[0], []).append((path, parsed[1]))

    def content(self, blob_hash: str) -> bytes | None:
        """Verified content of ``blob_hash``, or None when no good copy is there."""
        for path, codec in self.files.get(blob_hash, []):
            try:
                # No link followed, and a FIFO there is no file (never a read that hangs).
                fd = nofollow.open_file(self.root, path)
                if fd is None:
                    continue
                with os.fdopen(fd, "rb") as handle:
                    data = decode_blob(codec, handle.read())
            except (OSError, zlib.error, SymlinkRefused):
                continue
            if sha256_hex(data) == blob_hash:
                return data
        return None


def verify_blobs(
    store: BlobStore, *, repair_from: Path | None = None, progress: Progress | None = None
) -> VerifyReport:
    """Check, quarantine and (with ``repair_from``) repair every registered blob."""
    report = VerifyReport()
    known = KnownGood(repair_from) if repair_from is not None else None
    engine = store.index.engine
    with read_connection(engine) as conn:
        total = int(conn.execute(select(func.count()).select_from(_blobs)).scalar_one())
    registered: set[str] = set()
    after = ""
    while True:
        with read_connection(engine) as conn:
            rows = conn.execute(
                select(_blobs.c.hash, _blobs.c.size)
                .where(_blobs.c.hash > after)
                .order_by(_blobs.c.hash)
                .limit(PAGE)
            ).all()
        if not rows:
            break
        for row in rows:
            registered.add(row.hash)
            _verify_one(store, row.hash, int(row.size), report, known)
        after = rows[-1].hash
        if progress is not None:
            progress("blobs", report.checked, total)
    for found in store.iter_files():
        if found.hash not in registered:
            report.note("unregistered", found.hash)
    log.info("blobs verified", extra={"report": report.counts, "checked": report.checked})
    return report


def _verify_one(
    store: BlobStore, blob_hash: str, size: int, report: VerifyReport, known: KnownGood | None
) -> None:
    """Check one blob; a symlink on its way is reported, and the run goes on."""
    report.checked += 1
    try:
        if not store.has_stored(blob_hash):
            report.note("missing", blob_hash)
        elif store.check_stored(blob_hash, size) is None:
            report.ok += 1
            return
        elif _quarantine(store, blob_hash, size, report):
            report.ok += 1  # repaired meanwhile, or a good copy under the other codec
            return
        good = known.content(blob_hash) if known is not None else None
        if good is not None:
            try:
                store.put(good)  # a put of the content re-writes and re-registers it
            except OSError as exc:  # what stands at its path (a directory): this blob only
                log.error("blob repair failed", extra={"blob_hash": blob_hash, "error": str(exc)})
                report.note("unrepaired", f"{blob_hash}: {exc.strerror or exc}")
                return
            report.note("repaired", blob_hash)
    except SymlinkRefused as exc:
        report.note_symlink(blob_hash, exc.path, _root(store))


def _root(store: BlobStore) -> Path | None:
    """The blob root of a store on files (where a link can be), else None."""
    return store.root if isinstance(store, FileBlobStore) else None


def _quarantine(store: BlobStore, blob_hash: str, size: int, report: VerifyReport) -> bool:
    """Move the corrupt files aside; whether the blob turned out fine after all."""
    try:
        # Re-checked under the row's lock: only files still bad move, a repaired one stays.
        for path in store.quarantine_corrupt(blob_hash, size):
            report.note("quarantined", path)
    except SymlinkRefused as exc:  # a linked corrupt/: the file stays, out of service
        report.note_symlink(blob_hash, exc.path, _root(store))
    problem = store.check_stored(blob_hash, size)
    if problem is None and store.has_stored(blob_hash):
        return True
    log.error("blob is corrupt", extra={"blob_hash": blob_hash, "problem": problem})
    report.note("corrupt", blob_hash)
    return False
