"""Blob GC (invariant 6).

Blob GC never holds the mark set in memory. It walks the ``blobs`` table in hash order, one
page at a time, and asks the manifest index per blob whether any ``blob_refs`` row names it
(``referenced``). So its cost follows the number of registered blobs and candidates, and the
journal's size only through the depth of one index.

A candidate (unreferenced, ``last_written_at`` before the cutoff) is swept like this, one
chunk per write transaction:

1. lock its row: ``FOR UPDATE SKIP LOCKED`` on PostgreSQL (a writer that holds the row is
   about to refresh or reference it, so it is skipped, not waited for); SQLite's
   ``BEGIN IMMEDIATE`` already excludes every writer;
2. re-check in a NEW statement (so PostgreSQL takes a fresh snapshot, seeing every append
   that committed before the lock was granted) that it is still unreferenced and still old;
3. remove the file while the lock is held, delete the row, commit.

An append share-locks its blobs' rows and fails with ``BlobsMissing`` once a row is gone,
and a put upserts the row and re-creates a missing file under the same lock: a writer
racing GC re-creates the blob instead of referencing a missing file.

On SQLite with blobs on S3 the order differs (``_sweep_moved_first``): SQLite's lock is the
whole database's and an S3 call can take a minute with retries, so the objects move aside
first, with no lock held, and then a short write transaction re-checks and deletes the rows;
the objects of the blobs it keeps go back. A put's registration commits either before that
transaction (then it sees the blob refreshed or referenced) or after it, and then finds the
object moved and re-creates it: the same guarantee, by order instead of by lock.

Files never registered (a crash between the durable write and the registration) are swept
when older than the grace window, each under a placeholder row that stands in for the row
lock; temporary ``.tmp-*.part`` files only when much older (a slow write may still own one).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import (
    Connection,
    Engine,
    String,
    any_,
    bindparam,
    delete,
    func,
    literal,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.sql.elements import ColumnElement

from core import nofollow
from core.blobs.files import FileBlobStore, fanout_entries
from core.blobs.store import BlobStore, is_valid_hash, parse_blob_name
from core.db import is_sqlite, read_connection, write_transaction
from core.errors import StorageUnavailable, SymlinkRefused
from core.fsio import path_text
from core.journal.validation import check_limit, check_seconds
from core.maintenance.runs import Progress
from core.metrics import metrics
from core.models import BlobRefRow, BlobRow, database_now, table_of, utcnow

log = logging.getLogger(__name__)
_monotonic = time.monotonic  # the budget's clock (a test drives it)

_blobs = table_of(BlobRow)
_refs = table_of(BlobRefRow)


DEFAULT_BATCH = 1000
# Candidates swept per write transaction: bounds how long a writer can wait on GC's locks.
SWEEP_CHUNK = 100
# A temporary file is swept only after this long, whatever the grace: a slow put owns it.
TEMP_MIN_AGE_S = 3600.0
TEMP_PREFIX, TEMP_SUFFIX = ".tmp-", ".part"
MAX_ERRORS_KEPT = 50
SAMPLE_SIZE = 20
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_T = TypeVar("_T")

# "Does any manifest row name this blob?": one probe of the manifest's hash index per blob.
# A scalar subquery with LIMIT 1 rather than EXISTS, because PostgreSQL may run an EXISTS
# as a hashed subplan that reads the whole manifest for every page: cost by journal size.
_first_ref = select(literal(1)).where(_refs.c.hash == _blobs.c.hash).limit(1).scalar_subquery()
_referenced = _first_ref.is_not(None)


# reports --------------------------------------------------------------------------------


@dataclass(slots=True)
class GcReport:
    """What one GC run found and did. On a dry run, ``deleted`` and the byte counts say what
    an ``apply`` run would delete (``to_dict`` names it ``would_delete``)."""

    applied: bool
    grace_s: float
    cutoff: datetime
    scanned: int = 0  # registered blobs looked at
    referenced: int = 0  # registered blobs the manifest names: the distinct referenced hashes
    young: int = 0  # unreferenced, but written inside the grace window: kept
    candidates: int = 0  # unreferenced and older than the cutoff
    deleted: int = 0
    blob_bytes: int = 0  # stored bytes of the deleted blobs
    skipped: int = 0  # candidates a writer held, refreshed or referenced before the sweep
    orphans: int = 0  # files never registered, older than the cutoff
    orphan_bytes: int = 0
    temp_files: int = 0  # stale temporary files of interrupted writes
    temp_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    error_count: int = 0
    # False when the time budget, a database or a blob store error cut it short
    complete: bool = True
    # What cut it short, if a storage failure did: "database", or the blob store's component
    unavailable: str | None = None
    # Where a run its time budget cut short stopped: the next budgeted run starts there
    # (``GcResume``), so a store too big for one run is still swept whole, run after run.
    resume: GcResume | None = None
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def would_delete(self) -> int:
        return 0 if self.applied else self.deleted

    @property
    def bytes_freed(self) -> int:
        return self.blob_bytes + self.orphan_bytes + self.temp_bytes

    def error(self, message: str) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_ERRORS_KEPT:  # bounded, however many files fail
            self.errors.append(message)

    def counts(self) -> dict[str, int]:
        """The figures a dry run predicts and an apply run then reports."""
        return {
            "scanned": self.scanned,
            "referenced": self.referenced,
            "young": self.young,
            "candidates": self.candidates,
            "deleted": self.deleted,
            "skipped": self.skipped,
            "bytes_freed": self.bytes_freed,
            "blob_bytes": self.blob_bytes,
            "orphans": self.orphans,
            "orphan_bytes": self.orphan_bytes,
            "temp_files": self.temp_files,
            "temp_bytes": self.temp_bytes,
        }

    def to_dict(self) -> dict[str, Any]:
        # Same order as counts(), with "deleted" named for what a dry run means by it.
        deleted_key = "deleted" if self.applied else "would_delete"
        counts = {deleted_key if k == "deleted" else k: v for k, v in self.counts().items()}
        return {
            "applied": self.applied,
            "grace_s": self.grace_s,
            "cutoff": self.cutoff.isoformat(),
            **counts,
            "errors": list(self.errors),
            "error_count": self.error_count,
            "complete": self.complete,
            "unavailable": self.unavailable,
            "resume": None if self.resume is None else self.resume.to_dict(),
            "seconds": round(self.seconds, 3),
            "phase_seconds": {k: round(v, 3) for k, v in self.phase_seconds.items()},
        }


# blob GC --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GcResume:
    """Where a budgeted run stopped: in the registered blobs after hash ``after``, or in
    the files after key ``after`` (``<h[0:2]>/<h[2:4]>/<name>``; the next run sweeps them
    first). Read back from a run's report."""

    phase: str  # "blobs" or "files"
    after: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"phase": self.phase, "after": self.after}

    @classmethod
    def from_report(cls, report: Any) -> GcResume | None:
        """The resume point a run's report names; None (start over) for anything else."""
        found = report.get("resume") if isinstance(report, dict) else None
        if not isinstance(found, dict):
            return None
        phase, after = found.get("phase"), found.get("after", "")
        if phase not in ("blobs", "files") or not isinstance(after, str):
            return None
        if after and not (is_valid_hash(after) if phase == "blobs" else _FILE_KEY.match(after)):
            return None
        return cls(phase, after)


_FILE_KEY = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[^/]{1,1024}\Z")


@dataclass(frozen=True, slots=True)
class Candidate:
    hash: str
    stored_size: int


@dataclass(frozen=True, slots=True)
class ScannedPage:
    last_hash: str | None  # None: the table has no blob after the page's start
    scanned: int
    referenced: int
    young: int
    candidates: list[Candidate]


class BlobGc:
    """One GC run over one blob store; ``run()`` does all of it, in bounded memory."""

    def __init__(
        self,
        engine: Engine,
        blobs: BlobStore,
        *,
        apply: bool,
        grace_s: float,
        batch_size: int = DEFAULT_BATCH,
        progress: Progress | None = None,
        time_budget_s: float | None = None,
        now: datetime | None = None,
        resume: GcResume | None = None,
    ) -> None:
        grace_s = check_seconds(grace_s, "grace")
        check_limit(batch_size, "batch_size")
        self.engine = engine
        self.blobs = blobs
        self.apply = apply
        self.batch_size = batch_size
        self.progress = progress
        grace = timedelta(seconds=grace_s)
        # Two clocks, each against what stamped the ages it judges: a row's
        # ``last_written_at`` is the database's clock (its writer, on any host, stamps it
        # so), a file's age this host's (an object's, S3's clock offset to this host's).
        self.now = now or utcnow()
        self._grace = grace
        self._read_database_clock = now is None  # in ``run``: a database away is reported
        self.cutoff = self.file_cutoff = self.now - grace
        self.report = GcReport(applied=apply, grace_s=grace_s, cutoff=self.cutoff)
        self._started = _monotonic()
        self._deadline = None if time_budget_s is None else self._started + time_budget_s
        self._resume = resume
        self._at: GcResume | None = None
        self._files_first = resume is not None and resume.phase == "files"
        # SQLite's write lock is the whole database's: never held through a network call
        self._moves_first = blobs.network_outside_lock

    def run(self) -> GcReport:
        try:
            if self._read_database_clock:
                self.cutoff = self.report.cutoff = database_now(self.engine) - self._grace
            if self.apply:
                self.recover_quarantined()
            phases = [("blobs", self._sweep_registered), ("files", self._sweep_files)]
            if self._files_first:
                phases.reverse()  # the last run never got to them
            for phase, sweep in phases:
                if self.report.resume is not None:
                    break  # out of time
                started = _monotonic()
                sweep()
                self.report.phase_seconds[phase] = _monotonic() - started
        except SQLAlchemyError as exc:
            # The database went away mid-run: what was committed stays done; report it.
            self.report.complete = False
            self.report.unavailable = "database"
            self._stopped_at_error()
            self.report.error(f"database error, run stopped: {exc}")
            log.error("blob GC stopped by a database error", extra={"error": repr(exc)})
        except StorageUnavailable as exc:
            # The blob store went away (S3 down): the same, instead of waiting out its
            # retries blob after blob, inside the sweep's transaction. Before anything was
            # collected there is nothing to report: the caller gets the typed error itself.
            if not (self.report.deleted or self.report.orphans or self.report.temp_files):
                raise
            self.report.complete = False
            self.report.unavailable = exc.component
            self._stopped_at_error()
            self.report.error(f"blob store unavailable, run stopped: {exc}")
            log.error("blob GC stopped: the blob store is unavailable", extra={"error": repr(exc)})
        self.report.seconds = _monotonic() - self._started
        log.info("blob GC finished", extra={"gc": self.report.to_dict()})
        return self.report

    def _reached(self, where: GcResume) -> GcResume:
        """Record how far the phase has got (all before ``where`` is done): a run that an
        error stops hands the next one this point, as a run out of time does."""
        self._at = where
        return where

    def _stopped_at_error(self) -> None:
        if self.report.resume is None and self.apply:
            self.report.resume = self._at

    def _out_of_time(self, where: GcResume) -> bool:
        if self._deadline is not None and _monotonic() > self._deadline:
            self.report.complete = False
            self.report.resume = where
            return True
        return False

    def _tick(self, phase: str, done: int, total: int | None) -> None:
        if self.progress is not None:
            self.progress(phase, done, total)

    # registered blobs -------------------------------------------------------------------

    def _sweep_registered(self) -> None:
        resume = self._resume
        after = resume.after if resume is not None and resume.phase == "blobs" else ""
        self._reached(GcResume("blobs", after))
        total = self._count_blobs()
        self._tick("blobs", 0, total)
        while not self._out_of_time(self._reached(GcResume("blobs", after))):
            page = self.scan_page(after)
            if page.last_hash is None:
                break
            self._account(page)
            for chunk in _chunks(page.candidates, SWEEP_CHUNK):
                if self.apply:
                    self.sweep(chunk)
                else:
                    self._would_sweep(chunk)
            self._tick("blobs", self.report.scanned, total)
            after = page.last_hash

    def _count_blobs(self) -> int:
        with read_connection(self.engine) as conn:
            return int(conn.execute(select(func.count()).select_from(_blobs)).scalar_one())

    def scan_page(self, after: str) -> ScannedPage:
        """The next ``batch_size`` registered blobs after hash ``after`` (keyset paging)."""
        query = (
            select(
                _blobs.c.hash,
                _blobs.c.stored_size,
                _blobs.c.last_written_at,
                _referenced.label("referenced"),
            )
            .where(_blobs.c.hash > after)
            .order_by(_blobs.c.hash)
            .limit(self.batch_size)
        )
        with read_connection(self.engine) as conn:
            rows = conn.execute(query).all()
        unreferenced = [r for r in rows if not r.referenced]
        old = [r for r in unreferenced if r.last_written_at < self.cutoff]
        return ScannedPage(
            last_hash=rows[-1].hash if rows else None,
            scanned=len(rows),
            referenced=len(rows) - len(unreferenced),
            young=len(unreferenced) - len(old),
            candidates=[Candidate(r.hash, int(r.stored_size)) for r in old],
        )

    def _account(self, page: ScannedPage) -> None:
        self.report.scanned += page.scanned
        self.report.referenced += page.referenced
        self.report.young += page.young
        self.report.candidates += len(page.candidates)

    def _would_sweep(self, chunk: Sequence[Candidate]) -> None:
        self.report.deleted += len(chunk)
        self.report.blob_bytes += sum(c.stored_size for c in chunk)

    def sweep(self, chunk: Sequence[Candidate]) -> None:
        """Delete the candidates that are still garbage under their row locks (invariant 6).

        Files are moved aside under the lock and deleted only after the row delete commits;
        a failed commit puts them back, and a crash leaves them for ``recover_quarantined``.
        On SQLite with a ``remote`` blob store the moves come first (``_sweep_moved_first``).
        """
        if self._moves_first:
            self._sweep_moved_first(chunk)
            return
        moved: dict[str, list[Path]] = {}
        eligible: list[tuple[str, int]] = []
        try:
            with write_transaction(self.engine) as conn:
                eligible = self._recheck(conn, self._lock(conn, sorted(c.hash for c in chunk)))
                away = self._quarantine(eligible, moved)
                self._delete_rows(conn, list(moved))
        except BaseException:
            self.blobs.restore_quarantined(_flat(moved.values()))
            raise
        self._collected(len(chunk) - len(eligible), eligible, moved, set(moved))
        if away is not None:
            raise away  # the moves made are committed; the rest waits for the next run

    def _sweep_moved_first(self, chunk: Sequence[Candidate]) -> None:
        """``sweep`` on SQLite with a ``remote`` blob store: no S3 call under the write lock.

        SQLite's write lock is the whole database's, and an S3 call can take the store's
        timeout and retry window (``SESSIONSTORE_S3_*``): made under it, every writer would
        wait that long, or fail as "database is locked". So the objects move aside first,
        with no lock; then one short write transaction re-checks and deletes the rows still
        garbage; the others' objects go back. Invariant 6 holds by order: a put that
        registers a blob commits either before that transaction (which then sees it
        refreshed or referenced, and keeps it), or after it, and then re-checks the object
        under its own lock (``BlobStore._ensure``) after the move, and re-creates it."""
        # Re-checked first without a lock: fewer blobs a writer took since the scan move.
        with read_connection(self.engine) as conn:
            eligible = self._recheck(conn, sorted(c.hash for c in chunk))
        moved: dict[str, list[Path]] = {}
        try:
            away = self._quarantine(eligible, moved)
            with write_transaction(self.engine) as conn:
                gone = {h for h, _ in self._recheck(conn, sorted(moved))}
                self._delete_rows(conn, sorted(gone))
        except BaseException:
            self.blobs.restore_quarantined(_flat(moved.values()))
            raise
        kept = len(chunk) - len(eligible) + len(moved) - len(gone)  # as the locks would
        self._collected(kept, eligible, moved, gone)
        if away is not None:
            raise away

    def _delete_rows(self, conn: Connection, hashes: list[str]) -> None:
        if hashes:
            conn.execute(delete(_blobs).where(_blobs.c.hash.in_(hashes)))

    def _collected(
        self,
        skipped: int,
        eligible: list[tuple[str, int]],
        moved: dict[str, list[Path]],
        gone: set[str],
    ) -> None:
        """Count the rows deleted (``gone``), purge their files, put the others' back."""
        sizes = dict(eligible)
        self.report.skipped += skipped
        self.report.deleted += len(gone)
        self.report.blob_bytes += sum(sizes[h] for h in gone if moved[h])
        self.blobs.restore_quarantined(_flat(a for h, a in moved.items() if h not in gone))
        self.blobs.purge_quarantined(_flat(a for h, a in moved.items() if h in gone))

    def recover_quarantined(self) -> None:
        """Files a GC moved aside and never purged: back if still registered, else gone."""
        found = list(self.blobs.iter_quarantined())
        if not found:
            return
        registered = self._registered_among({h for h, _ in found})
        keep = [path for h, path in found if h in registered]
        self.blobs.restore_quarantined(keep)
        self.blobs.purge_quarantined([path for h, path in found if h not in registered])
        log.warning(
            "recovered files of an interrupted GC",
            extra={"restored": len(keep), "purged": len(found) - len(keep)},
        )

    def _lock(self, conn: Connection, hashes: list[str]) -> list[str]:
        query = select(_blobs.c.hash).where(_blobs.c.hash.in_(hashes)).order_by(_blobs.c.hash)
        if not is_sqlite(self.engine):
            # Hash order, like every other blob-row locker; SKIP LOCKED never waits at all.
            query = query.with_for_update(skip_locked=True)
        return list(conn.execute(query).scalars())

    def _recheck(self, conn: Connection, locked: list[str]) -> list[tuple[str, int]]:
        """Still unreferenced and still old, seen by a statement that began after the lock."""
        if not locked:
            return []
        query = (
            select(_blobs.c.hash, _blobs.c.stored_size)
            .where(
                _blobs.c.hash.in_(locked),
                _blobs.c.last_written_at < self.cutoff,
                ~_referenced,
            )
            .order_by(_blobs.c.hash)
        )
        return [(r.hash, int(r.stored_size)) for r in conn.execute(query)]

    def _quarantine(
        self, eligible: list[tuple[str, int]], moved: dict[str, list[Path]]
    ) -> StorageUnavailable | None:
        """Move the files aside, into ``moved`` by hash (as they go, so that a failure
        that escapes still knows them); the store's failure that stopped it, if any.

        A file that cannot go (a planted link, a permission) is skipped; a store that is
        unavailable stops the chunk at once, since each further try would wait out its
        retries (S3: ``SESSIONSTORE_S3_RETRY_SECONDS``) while this transaction holds the
        candidates' row locks."""
        for blob_hash, _ in eligible:
            try:
                aside = self.blobs.quarantine_file(blob_hash)
            except StorageUnavailable as exc:
                # The file may still be there: keep its row, so it stays a valid blob.
                self.report.error(f"blob {blob_hash}: cannot remove: {exc}")
                return exc
            except (OSError, SymlinkRefused) as exc:
                self.report.error(f"blob {blob_hash}: cannot remove: {exc}")
                continue
            if not aside:
                log.warning("registered blob had no file", extra={"blob_hash": blob_hash})
            moved[blob_hash] = aside
        return None

    # files on disk: never registered, or temporary --------------------------------------

    def _sweep_files(self) -> None:
        seen = 0
        self._tick("files", 0, None)
        resume = self._resume
        after = resume.after if resume is not None and resume.phase == "files" else ""
        self._reached(GcResume("files", after))
        # Walked in key order, the files have a cursor as the blobs do: a walk longer than
        # one run's budget goes on from its last key in the next (files first).
        for chunk in _chunks(self._files(after), self.batch_size):
            if self._out_of_time(self._reached(GcResume("files", after))):
                return
            after = chunk[-1].key
            seen += len(chunk)
            hashes = {f.hash for f in chunk if f.hash is not None}
            registered = self._registered_among(hashes)
            unregistered = [f for f in chunk if f.hash is not None and f.hash not in registered]
            self._sweep_orphans(_stat_all(unregistered))
            self._sweep_temps(_stat_all([f for f in chunk if f.hash is None]))
            self._tick("files", seen, None)

    def _files(self, after: str) -> Iterator[FoundFile]:
        if isinstance(self.blobs, FileBlobStore):
            return file_tree(self.blobs.root, after)  # stats only what it must (file_tree)
        # object times are the store's: judged by this host's clock, as files' are
        offset = self.blobs.clock_offset(required=self.apply)  # a dry run may only read
        return (  # an object's path is its key
            FoundFile(f.hash, str(f.path), str(f.path), f.stored_size, f.modified_at - offset)
            for f in self.blobs.iter_files(after)
        )

    def _registered_among(self, hashes: set[str]) -> set[str]:
        if not hashes:
            return set()
        match: ColumnElement[bool]
        if is_sqlite(self.engine):
            match = _blobs.c.hash.in_(sorted(hashes))
        else:
            # One array parameter, not a thousand: the IN list's binding cost dominated.
            match = _blobs.c.hash == any_(bindparam("hashes", sorted(hashes), ARRAY(String)))
        query = select(_blobs.c.hash).where(match)
        with read_connection(self.engine) as conn:
            return set(conn.execute(query).scalars())

    def _sweep_orphans(self, files: list[FoundFile]) -> None:
        cutoff_ts = self.file_cutoff.timestamp()
        old = [f for f in files if f.mtime is not None and f.mtime < cutoff_ts]
        for blob_hash, group in _by_hash(old):
            if not self.apply or self._remove_orphan(blob_hash):
                self.report.orphans += len(group)
                self.report.orphan_bytes += sum(f.size or 0 for f in group)

    def _remove_orphan(self, blob_hash: str) -> bool:
        """Remove an unregistered blob's file under a placeholder row.

        The placeholder takes the key's lock: a put registering this hash meanwhile waits
        for it (then re-creates the file), and if a put registered it first, the insert
        finds its row and the file is left alone. The placeholder never commits.
        """
        if self._moves_first:
            return self._remove_orphan_moved_first(blob_hash)
        with write_transaction(self.engine) as conn:
            if conn.execute(self._placeholder(blob_hash)).first() is None:
                return False  # registered since the scan: not an orphan
            try:
                removed = self.blobs.remove_file(blob_hash)
            except (OSError, SymlinkRefused, StorageUnavailable) as exc:
                self.report.error(f"orphan {blob_hash}: cannot remove: {exc}")
                removed = False
            conn.execute(delete(_blobs).where(_blobs.c.hash == blob_hash))
        return removed

    def _remove_orphan_moved_first(self, blob_hash: str) -> bool:
        """``_remove_orphan`` as ``_sweep_moved_first`` sweeps: the objects move aside with
        no lock, then a write transaction (it waits for a put registering the hash to
        commit) says whether a put registered it; if so they go back, else they go."""
        try:
            moved = self.blobs.quarantine_file(blob_hash)
        except (OSError, SymlinkRefused, StorageUnavailable) as exc:
            self.report.error(f"orphan {blob_hash}: cannot remove: {exc}")
            return False
        try:
            with write_transaction(self.engine) as conn:
                registered = self.blobs.index.lock(conn, blob_hash)
        except BaseException:
            self.blobs.restore_quarantined(moved)
            raise
        if registered:
            self.blobs.restore_quarantined(moved)
            return False
        self.blobs.purge_quarantined(moved)
        return bool(moved)

    def _placeholder(self, blob_hash: str) -> Any:
        insert_ = sqlite_insert if is_sqlite(self.engine) else pg_insert
        values = {
            "hash": blob_hash,
            "size": 0,
            "stored_size": 0,
            "codec": "identity",
            "created_at": _EPOCH,
            "last_written_at": _EPOCH,
        }
        return (
            insert_(_blobs)
            .values(values)
            .on_conflict_do_nothing(index_elements=[_blobs.c.hash])
            .returning(_blobs.c.hash)
        )

    def _sweep_temps(self, files: list[FoundFile]) -> None:
        # A put owns its temporary file until the rename, however long it takes: a far
        # longer wait than the grace window before calling one abandoned.
        age = max(self.report.grace_s, TEMP_MIN_AGE_S)
        limit = (self.now - timedelta(seconds=age)).timestamp()
        for f in files:
            if f.mtime is None or f.mtime >= limit:
                continue
            if self.apply:
                try:
                    self._remove_temp(f.path)
                except FileNotFoundError:
                    continue
                except (OSError, SymlinkRefused) as exc:
                    # a name that is not UTF-8 as \xff: the report is stored as JSON text
                    self.report.error(f"temp file {path_text(f.path)}: cannot remove: {exc}")
                    continue
            self.report.temp_files += 1
            self.report.temp_bytes += f.size or 0

    def _remove_temp(self, path: str) -> None:
        if isinstance(self.blobs, FileBlobStore):  # through no link below the root
            nofollow.unlink(self.blobs.root, Path(path))
        else:
            os.unlink(path)


@dataclass(frozen=True, slots=True)
class FoundFile:
    """A file in the blob store: a blob's (``hash``) or a temporary one (``hash`` None)."""

    hash: str | None
    path: str
    key: str  # ``<h[0:2]>/<h[2:4]>/<name>``: where a walk in key order stands
    size: int | None = None  # None until stat'ed
    mtime: float | None = None


def file_tree(root: Path, after: str = "") -> Iterator[FoundFile]:
    """Blob and temporary files in FileBlobStore's two fan-out levels, in one walk, in key
    order from past the key ``after``.

    Names only, no stat: most blob files are registered and need none, so the caller stats
    just the rest. (``iter_files`` stats every file and skips temporary ones.)
    """
    for key, entry in fanout_entries(root, after):
        found = _classify(entry.name, entry.path, key)
        if found is not None:
            yield found


def _classify(name: str, path: str, key: str) -> FoundFile | None:
    if name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX):
        return FoundFile(None, path, key)
    parsed = parse_blob_name(name)
    return FoundFile(parsed[0], path, key) if parsed is not None else None


def _stat_all(files: list[FoundFile]) -> list[FoundFile]:
    """The files with size and mtime filled in; files gone meanwhile are left out."""
    out: list[FoundFile] = []
    for f in files:
        if f.mtime is not None:
            out.append(f)
            continue
        try:
            stat = os.stat(f.path, follow_symlinks=False)
        except FileNotFoundError:
            continue
        out.append(FoundFile(f.hash, f.path, f.key, stat.st_size, stat.st_mtime))
    return out


def _chunks(items: Iterable[_T], size: int) -> Iterator[list[_T]]:
    iterator = iter(items)
    while chunk := list(islice(iterator, size)):
        yield chunk


def _flat(groups: Iterable[list[Path]]) -> list[Path]:
    return [path for group in groups for path in group]


def _by_hash(files: Iterable[FoundFile]) -> list[tuple[str, list[FoundFile]]]:
    grouped: dict[str, list[FoundFile]] = {}
    for f in files:
        if f.hash is not None:
            grouped.setdefault(f.hash, []).append(f)
    return sorted(grouped.items())


def gc_blobs(
    engine: Engine,
    blobs: BlobStore,
    *,
    apply: bool,
    grace_s: float,
    batch_size: int = DEFAULT_BATCH,
    progress: Progress | None = None,
    time_budget_s: float | None = None,
    resume: GcResume | None = None,
) -> GcReport:
    """Collect unreferenced blobs older than ``grace_s``; a dry run unless ``apply``.
    ``resume``: where an earlier run its time budget cut short stopped (its report's)."""
    report = BlobGc(
        engine,
        blobs,
        apply=apply,
        grace_s=grace_s,
        batch_size=batch_size,
        progress=progress,
        time_budget_s=time_budget_s,
        resume=resume,
    ).run()
    if apply:
        observed = metrics()
        observed.maintenance_runs.labels("gc_blobs").inc()
        observed.maintenance_removed.labels("gc_blobs").inc(report.deleted + report.orphans)
    return report
