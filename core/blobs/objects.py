"""Blobs on S3-compatible object storage (``s3://bucket/prefix``), through obstore.

obstore is the object-store library: one API for S3, GCS, Azure and local files, a Rust
core (fast, no botocore start-up cost), and conditional puts, which content addressing
needs. It reads the standard AWS variables (``AWS_ACCESS_KEY_ID``, ``AWS_REGION``,
``AWS_ENDPOINT_URL``, ``AWS_ALLOW_HTTP`` …), so any S3-compatible service works.

The guarantees of the file backend, by object-storage means:

- A put never overwrites good content: it is a conditional create (``If-None-Match``);
  on a collision the stored object is verified against the hash, and only a corrupt one
  is overwritten.
- An object is whole or absent (S3 puts are atomic), so no temporary objects exist.
- GC's "move aside under the row lock" is a server-side copy to ``.gc/`` plus a delete;
  ``purge``/``restore`` finish or undo it, as on disk (on SQLite, before the row lock:
  ``core.maintenance.gc``). A restore verifies the aside and never replaces an intact
  object; a lookup or read that finds no object restores an aside it finds, as on disk.
  Its grace window reads the object's ``last_modified``.
- Keys are built in one place from a validated hash (invariant 9).
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import obstore
from obstore.exceptions import AlreadyExistsError, PermissionDeniedError, UnauthenticatedError
from obstore.store import S3Store
from sqlalchemy import literal_column
from sqlalchemy.dialects.postgresql import insert as pg_insert

if TYPE_CHECKING:
    from obstore.store import ClientConfig

from core.blobs.store import (
    CORRUPT_DIR,
    CORRUPT_STAMP,
    STREAM_CHUNK,
    SUFFIXES,
    BlobFile,
    BlobIndex,
    BlobStore,
    Codec,
    StagedPuts,
    _Stored,
    by_hash,
    check_hash,
    decode_blob,
    encode_blob,
    parse_blob_name,
    rows_of,
    sha256_hex,
)
from core.db import retry_deadlocks, write_transaction
from core.errors import StorageUnavailable
from core.models import BlobRow, postgres_statement_clock, table_of, utcnow
from core.translate import reason_of
from core.urls import hide_password

log = logging.getLogger(__name__)

QUARANTINE_PREFIX = ".gc"
_T = TypeVar("_T")


DEFAULT_S3_LIMITS = (30.0, 20.0)


def open_s3_store(
    url: str, component: str = "blobs", limits: tuple[float, float] = DEFAULT_S3_LIMITS
) -> S3Store:
    """An obstore S3 store for ``s3://bucket/prefix``, configured from the environment
    (the one place blobs and artifacts build their store).

    ``limits`` is (request timeout, retry window) in seconds (``Settings.s3_limits``). Left
    to obstore's defaults, an endpoint that accepts connections and never answers holds
    each call for 30 s per attempt, retried for 3 minutes."""
    timeout, retry = limits
    try:
        return S3Store.from_url(
            url,
            client_options=cast(
                "ClientConfig",
                {
                    **_client_options_from_env(),
                    "timeout": timedelta(seconds=timeout),
                    "connect_timeout": timedelta(seconds=min(5.0, timeout)),
                    "read_timeout": timedelta(seconds=min(10.0, timeout)),
                },
            ),
            retry_config={
                "max_retries": 10 if retry > 0 else 0,
                "retry_timeout": timedelta(seconds=retry),
                "backoff": {
                    "init_backoff": timedelta(milliseconds=100),
                    "max_backoff": timedelta(seconds=min(5.0, max(retry, 0.1))),
                    "base": 2.0,
                },
            },
        )
    except Exception as exc:  # obstore raises its own configuration errors
        reason = f"cannot open {hide_password(url)}: {reason_of(exc)}"
        raise StorageUnavailable(component, reason) from exc


_CLIENT_FLAGS = ("allow_http", "allow_invalid_certificates", "http1_only", "http2_only")
_CLIENT_STRINGS = ("proxy_url", "proxy_ca_certificate", "proxy_excludes", "user_agent")


def _client_options_from_env() -> dict[str, Any]:
    """The HTTP client's AWS_* variables (AWS_ALLOW_HTTP, AWS_PROXY_URL, ...): obstore reads
    them only when no client options are passed, and the timeouts are passed."""
    options: dict[str, Any] = {}
    for key in _CLIENT_FLAGS:
        value = os.environ.get(f"AWS_{key.upper()}")
        if value is not None:
            options[key] = value.strip().lower() in ("1", "true", "yes", "on")
    for key in _CLIENT_STRINGS:
        value = os.environ.get(f"AWS_{key.upper()}")
        if value:
            options[key] = value
    return options


_blobs = table_of(BlobRow)
# Takes each row's lock (inserting the rows of new blobs) and says which existed already,
# with their codec: PostgreSQL's ``xmax`` is 0 for a row this statement inserted.
# The times are the database's clock (see ``core.blobs.store._upsert_statement``).
_WRITTEN = postgres_statement_clock()
_LOCK_ROWS = (
    pg_insert(_blobs)
    .values(created_at=_WRITTEN, last_written_at=_WRITTEN)
    .on_conflict_do_update(index_elements=[_blobs.c.hash], set_={"last_written_at": _WRITTEN})
    .returning(_blobs.c.hash, _blobs.c.codec, literal_column("xmax = 0").label("inserted"))
)


# S3's error body for a request to a bucket that does not exist (a HEAD has no body)
_NO_SUCH_BUCKET = re.compile(
    r"<Code>NoSuchBucket</Code>(?:.*?<BucketName>([^<]*)</BucketName>)?", re.S
)


def storage_call(component: str, call: Callable[[], _T]) -> _T:
    """Run an object-store call; a missing object raises ``FileNotFoundError`` and a
    conditional-put collision ``AlreadyExistsError`` as obstore raises them, anything else
    (connection refused, timeouts, 5xx after obstore's retries) is ``StorageUnavailable``."""
    try:
        return call()
    except FileNotFoundError as exc:
        # A 404 is a missing object, unless the bucket is missing (deleted, or mistyped):
        # then every object would read as lost and every write fail as bad input.
        bucket = _NO_SUCH_BUCKET.search(str(exc))
        if bucket is None:
            raise
        raise StorageUnavailable(
            component,
            f"{component} is unavailable: the bucket {bucket.group(1) or '?'} does not exist",
        ) from exc
    except (AlreadyExistsError, StopIteration):
        raise
    except Exception as exc:
        raise StorageUnavailable(
            component, f"{component} is unavailable: {reason_of(exc)}"
        ) from exc


_CLOCK = ".health/clock"  # probe objects, listed alone (a prefix is a whole path segment)
_STAMP_RESOLUTION_S = 2.0
_PROBE_LEFT_S = 3600.0
# What a credential that may only read and list gets for the probe's write (403, 401)
_REFUSED = (PermissionDeniedError, UnauthenticatedError, PermissionError)


def clock_offset(store: S3Store, component: str, *, required: bool = True) -> float:
    """Seconds the object store's clock is ahead of this host's (negative: behind), for
    judging objects' ages: their last-modified times are the store's, and a host whose
    clock is hours off it took a fresh object for an old one. Read off a probe object the
    store stamps, against this host's clock halfway through the put; an offset within the
    stamps' resolution is none. Not ``required`` (a dry run, which writes nothing else: a
    read-only credential), a probe the store refuses is this host's clock, with a warning."""
    if not required:
        try:
            return clock_offset(store, component)
        except StorageUnavailable as exc:
            if not isinstance(exc.__cause__, _REFUSED):
                raise  # unreachable: the run fails now as it would at its listing
            log.warning(
                "cannot read the object store's clock: object ages by this host's",
                extra={"component": component, "error": str(exc)},
            )
            return 0.0
    key = f"{_CLOCK}/{uuid.uuid4().hex}"
    before = time.time()
    storage_call(component, lambda: obstore.put(store, key, b""))
    after = time.time()
    try:
        listed = storage_call(component, lambda: obstore.list(store, prefix=_CLOCK).collect())
    finally:
        storage_call(component, lambda: obstore.delete(store, key))
    stamped = [meta["last_modified"] for meta in listed if meta["path"] == key]
    if not stamped:
        raise StorageUnavailable(component, f"{component}: the object store lost a probe object")
    # A run killed between its probe's put and delete left its probe: an hour old by the
    # store's clock, no run still owns it (each lasts seconds), and the listing stays short.
    left = [
        str(meta["path"])
        for meta in listed
        if (stamped[0] - meta["last_modified"]).total_seconds() > _PROBE_LEFT_S
    ]
    if left:
        try:
            storage_call(component, lambda: obstore.delete(store, left))
        except StorageUnavailable as exc:  # tidying only: the next probe tries again
            log.warning(
                "cannot remove probe objects a killed run left",
                extra={"component": component, "keys": left[:10], "error": str(exc)},
            )
    offset = float(stamped[0].timestamp() - (before + after) / 2)
    # Stores stamp whole seconds (S3 lists .000): a second either way is that, not a skew
    return offset if abs(offset) > _STAMP_RESOLUTION_S else 0.0


class ObjectBlobStore(BlobStore):
    read_ahead = 8  # a GET is a round trip: overlapping them is the whole gain
    remote = True

    def __init__(self, store: S3Store, index: BlobIndex, *, gzip_level: int = 6) -> None:
        super().__init__(index, gzip_level=gzip_level)
        self.store = store

    def key_for(self, blob_hash: str, codec: Codec) -> str:
        """The one place a hash becomes a key; it validates first (invariant 9)."""
        check_hash(blob_hash)
        return f"{blob_hash[0:2]}/{blob_hash[2:4]}/{blob_hash}{SUFFIXES[codec]}"

    def _call(self, call: Callable[[], _T]) -> _T:
        return storage_call("blobs", call)

    def _head(self, key: str) -> dict[str, Any] | None:
        try:
            return dict(self._call(lambda: obstore.head(self.store, key)))
        except FileNotFoundError:
            return None

    def _get(self, key: str) -> bytes | None:
        try:
            return self._call(lambda: obstore.get(self.store, key).bytes().to_bytes())
        except FileNotFoundError:
            return None

    def _find(self, blob_hash: str, first: Codec | None = None) -> tuple[Codec, int] | None:
        found = self._find_stored(blob_hash, first)
        # A GC died between copy-aside and row delete: taken back (verified) as by a read,
        # so ``exists`` and ``blobs verify`` see it, as on disk (``FileBlobStore._find``)
        if found is None and self._unquarantine(blob_hash):
            found = self._find_stored(blob_hash, first)
        return found

    def _find_stored(self, blob_hash: str, first: Codec | None) -> tuple[Codec, int] | None:
        for codec in _codecs(first):
            meta = self._head(self.key_for(blob_hash, codec))
            if meta is not None:
                return codec, int(meta["size"])
        return None

    def _read(self, blob_hash: str) -> tuple[Codec, bytes] | None:
        # The registered codec's key first: a miss on the other key is a round trip.
        for codec in _codecs(self._registered_codec(blob_hash)):
            data = self._get(self.key_for(blob_hash, codec))
            if data is not None:
                return codec, data
        if self._unquarantine(blob_hash):  # a GC died between copy-aside and row delete
            return self._read(blob_hash)
        return None

    @contextmanager
    def _open(self, blob_hash: str) -> Iterator[tuple[Codec, Iterator[bytes]] | None]:
        yield self._open_stored(blob_hash)

    def _open_stored(self, blob_hash: str) -> tuple[Codec, Iterator[bytes]] | None:
        """As ``_read``, but a GET whose body streams (``STREAM_CHUNK`` at a time)."""
        for codec in _codecs(self._registered_codec(blob_hash)):
            key = self.key_for(blob_hash, codec)
            try:
                result = self._call(lambda key=key: obstore.get(self.store, key))  # type: ignore[misc]
            except FileNotFoundError:
                continue
            return codec, self._chunks(result.stream(min_chunk_size=STREAM_CHUNK))
        if self._unquarantine(blob_hash):  # a GC died between copy-aside and row delete
            return self._open_stored(blob_hash)
        return None

    def _chunks(self, stream: Iterator[Any]) -> Iterator[bytes]:
        """The body's chunks; a connection lost midway is ``StorageUnavailable``."""
        while True:
            try:
                chunk = self._call(lambda: next(stream))
            except StopIteration:
                return
            yield bytes(chunk)

    def _stage(self, blob_hash: str, data: bytes, first: Codec | None = None) -> _Stored:
        """Content the index knows takes the base path (look up, verify), its codec first.
        Content it does not know is most likely new: it goes straight to a conditional
        create, which verifies whatever it collides with (an orphan, a concurrent put), so
        a new blob costs no lookups before its PUT. ``_register`` re-checks under the lock."""
        registered = self._registered_codec(blob_hash)
        if registered is not None:
            return super()._stage(blob_hash, data, first or registered)
        codec, payload = encode_blob(data, level=self.gzip_level)
        written = self._create(blob_hash, codec, payload)
        return _Stored(codec, len(payload), payload, written=written)

    def stage_many(self, items: Sequence[bytes]) -> StagedPuts:
        """Staging registers too, in a transaction of its own (``register_staged`` then has
        nothing left to do, and the append share-locks the rows as it does any ref's): on
        PostgreSQL the objects are stored under their row locks; on SQLite the rows are
        registered after the objects are written and checked after that commit."""
        hashes, unique = by_hash(items)
        if self.network_outside_lock:
            final = self._register_then_check(unique, self._stage_all(unique))
        else:
            final = self._store_registered(unique)
        return StagedPuts(hashes, unique, final, registered=True, final=final)

    def _register_then_check(
        self, unique: dict[str, bytes], staged: dict[str, _Stored]
    ) -> dict[str, _Stored]:
        """On SQLite: the rows in a short write transaction, then every object checked
        (re-created if GC took it) with no lock held. SQLite's lock is the whole database's
        and an S3 call can take a minute with retries: checked inside the transaction, as
        the base order does, every writer of the database waited on each HEAD.

        Sound by order, as GC's sweep on SQLite is (``core.maintenance.gc``): GC moves
        objects aside first, then re-checks and deletes rows in one transaction. If ours
        commits first, GC sees the rows refreshed and puts the objects back; if after, its
        rows are new and the check, after our commit, finds an object GC moved aside gone
        and re-creates it. A row GC deletes between our commit and the append (a grace of
        0) fails the append with ``BlobsMissing``, which puts the blobs again (as on
        PostgreSQL, whose staging commits on its own too)."""
        now = utcnow()
        with write_transaction(self.index.engine) as conn:
            self.index.upsert(conn, rows_of(unique, staged, now))
        final, changed = self._ensure_all(unique, staged, now)
        if changed:  # the object was re-created: the row describes ours now
            with write_transaction(self.index.engine) as conn:
                self.index.upsert(conn, changed)
        return final

    def _store_registered(self, unique: dict[str, bytes]) -> dict[str, _Stored]:
        """On PostgreSQL: the rows first, then the objects, then the commit.

        GC removes an object only while it holds that hash's row lock (a placeholder row for
        an unregistered object, see ``core.maintenance.gc``), so an object written while this
        transaction holds the lock is still there when it commits: no presence re-check
        (one HEAD per new blob, a round trip as slow as the PUT itself), and the upsert that
        takes the lock also says which blobs were registered (no lookup before the PUT).
        SQLite's write lock is database-wide and is never held through network calls: the
        base order (write, then register and re-check) stays there."""
        encoded = {h: encode_blob(data, level=self.gzip_level) for h, data in unique.items()}
        return retry_deadlocks(lambda: self._store_under_locks(unique, encoded))

    def _store_under_locks(
        self, unique: dict[str, bytes], encoded: dict[str, tuple[Codec, bytes]]
    ) -> dict[str, _Stored]:
        now = utcnow()
        rows = {
            h: {
                "hash": h,
                "size": len(unique[h]),
                "stored_size": len(encoded[h][1]),
                "codec": encoded[h][0],
                "created_at": now,
                "last_written_at": now,
            }
            for h in sorted(unique)  # one lock order for every writer
        }
        final: dict[str, _Stored] = {}
        with write_transaction(self.index.engine) as conn:
            prior = {
                row.hash: row.codec
                for row in conn.execute(_LOCK_ROWS, list(rows.values()))
                if not row.inserted
            }
            for h in rows:
                codec, payload = encoded[h]
                if h in prior and prior[h] in SUFFIXES:
                    kept = self._verified(h, prior[h], len(unique[h]))
                    if kept is not None:
                        final[h] = kept
                        continue
                    self._discard_other_codecs(h, codec)
                written = self._create(h, codec, payload)
                final[h] = _Stored(codec, len(payload), payload, written=written)
            rewritten = [rows[h] for h in prior if final[h].written]
            if rewritten:  # the object was missing or corrupt: the row describes ours now
                self.index.upsert(conn, rewritten)
        return final

    def _verified(self, blob_hash: str, codec: Codec, size: int) -> _Stored | None:
        """The registered object if it holds this content (size, then hash), else None."""
        stored = self._get(self.key_for(blob_hash, codec))
        if stored is None:
            log.warning(
                "registered blob object missing; re-creating", extra={"blob_hash": blob_hash}
            )
            return None
        try:
            data = decode_blob(codec, stored)
            intact = len(data) == size and sha256_hex(data) == blob_hash
        except Exception:
            intact = False
        if not intact:
            # Invariant 13: a re-put of the content repairs a damaged object, never trusts it.
            log.warning(
                "stored blob object is corrupt; replacing it", extra={"blob_hash": blob_hash}
            )
            return None
        return _Stored(codec, len(stored), None, written=False)

    def _registered_codec(self, blob_hash: str) -> Codec | None:
        codec = self.index.codec_of(blob_hash)
        if codec is None or codec not in SUFFIXES:
            return None
        return codec

    def _write(self, blob_hash: str, codec: Codec, payload: bytes) -> None:
        self._create(blob_hash, codec, payload)

    def _create(self, blob_hash: str, codec: Codec, payload: bytes) -> bool:
        """Create the object unless it exists; True if this call wrote it."""
        key = self.key_for(blob_hash, codec)
        try:
            self._call(lambda: obstore.put(self.store, key, payload, mode="create"))
            return True
        except AlreadyExistsError:
            pass
        # Someone stored this key first: keep theirs if it is this content, else repair.
        if self._intact(blob_hash, codec):
            return False
        log.warning("stored blob object is corrupt; overwriting it", extra={"blob_hash": blob_hash})
        self._call(lambda: obstore.put(self.store, key, payload, mode="overwrite"))
        return True

    def _intact(self, blob_hash: str, codec: Codec) -> bool:
        stored = self._get(self.key_for(blob_hash, codec))
        if stored is None:
            return False
        try:
            return sha256_hex(decode_blob(codec, stored)) == blob_hash
        except Exception:
            return False

    def remove_file(self, blob_hash: str) -> bool:
        removed = False
        for codec in SUFFIXES:
            key = self.key_for(blob_hash, codec)
            if self._head(key) is not None:
                self._call(lambda key=key: obstore.delete(self.store, key))  # type: ignore[misc]
                removed = True
        return removed

    def quarantine_file(self, blob_hash: str) -> list[Path]:
        return [
            Path(a) for a in self._move_aside(blob_hash, lambda key: f"{QUARANTINE_PREFIX}/{key}")
        ]

    def _discard_other_codecs(self, blob_hash: str, keep: Codec) -> None:
        for codec in SUFFIXES:
            key = self.key_for(blob_hash, codec)
            if codec != keep and self._head(key) is not None:
                self._call(lambda key=key: obstore.delete(self.store, key))  # type: ignore[misc]

    def _read_codec(self, blob_hash: str, codec: Codec) -> bytes | None:
        return self._get(self.key_for(blob_hash, codec))

    def _move_corrupt(self, blob_hash: str, codec: Codec, stamp: str) -> str | None:
        # Outside the fan-out layout, so ``iter_files`` never takes it for a blob.
        key = self.key_for(blob_hash, codec)
        return self._move_one(key, f"{CORRUPT_DIR}/{key}.{stamp}")

    def _move_aside(self, blob_hash: str, aside_of: Callable[[str], str]) -> list[str]:
        """Move each stored object of the hash to ``aside_of(key)``."""
        moved: list[str] = []
        for codec in SUFFIXES:
            key = self.key_for(blob_hash, codec)
            aside = self._move_one(key, aside_of(key))
            if aside is not None:
                moved.append(aside)
        return moved

    def _move_one(self, key: str, aside: str) -> str | None:
        """Copy ``key`` to ``aside``, then delete it; None when there is no such object."""
        try:
            self._call(lambda: obstore.copy(self.store, key, aside))
        except FileNotFoundError:
            return None
        self._call(lambda: obstore.delete(self.store, key))
        return aside

    def purge_quarantined(self, moved: Sequence[Path]) -> None:
        keys = [p.as_posix() for p in moved]
        if keys:
            self._call(lambda: obstore.delete(self.store, keys))

    def restore_quarantined(self, moved: Sequence[Path]) -> None:
        """Put each aside back, verified first (invariant 13). No restore runs under the
        row's lock, so a writer may have stored the blob again meanwhile: an aside whose
        blob has an intact object again is only dropped, and a damaged aside goes to
        ``corrupt/``, never over or in place of good content. (A lookup or read that finds
        no object takes an aside back this way itself, here as on disk: ``_find``.)"""
        for path in moved:
            self._restore_one(path.as_posix())

    def _restore_one(self, aside: str) -> None:
        original = aside[len(QUARANTINE_PREFIX) + 1 :]
        parsed = parse_blob_name(original.rsplit("/", 1)[-1])
        if parsed is None:
            return  # never an aside of ours: ``quarantine_file`` names them
        blob_hash, codec = parsed
        if not self._has_intact(blob_hash):
            stored = self._get(aside)
            if stored is None:
                return  # restored or purged meanwhile
            if self._problem(blob_hash, codec, stored, None) is not None:
                stamp = utcnow().strftime(CORRUPT_STAMP)
                log.error("a blob object GC moved aside is corrupt", extra={"blob_hash": blob_hash})
                self._move_one(aside, f"{CORRUPT_DIR}/{original}.{stamp}")
                return
            try:
                self._call(lambda: obstore.copy(self.store, aside, original))
            except FileNotFoundError:
                return
        self._call(lambda: obstore.delete(self.store, aside))

    def _has_intact(self, blob_hash: str) -> bool:
        """Whether an object of the hash, under any codec, holds its content."""
        for codec in SUFFIXES:
            stored = self._read_codec(blob_hash, codec)
            if stored is not None and self._problem(blob_hash, codec, stored, None) is None:
                return True
        return False

    def _unquarantine(self, blob_hash: str) -> bool:
        asides = [
            Path(f"{QUARANTINE_PREFIX}/{self.key_for(blob_hash, codec)}") for codec in SUFFIXES
        ]
        present = [a for a in asides if self._head(a.as_posix()) is not None]
        self.restore_quarantined(present)
        return bool(present)

    def iter_quarantined(self) -> Iterator[tuple[str, Path]]:
        for meta in self._list(QUARANTINE_PREFIX + "/"):
            parsed = parse_blob_name(meta["path"].rsplit("/", 1)[-1])
            if parsed is not None:
                yield parsed[0], Path(meta["path"])

    def iter_files(self, after: str = "") -> Iterator[BlobFile]:
        # S3 lists keys in order (UTF-8 binary), past ``after`` when given (StartAfter);
        # times by the store's clock (``clock_offset`` tells this host's)
        for meta in self._list(None, offset=after or None):
            key = str(meta["path"])
            parsed = parse_blob_name(key.rsplit("/", 1)[-1])
            if parsed is None or key.startswith(QUARANTINE_PREFIX + "/"):
                continue
            if key != self.key_for(*parsed):  # only the canonical layout is ours
                continue
            modified = meta["last_modified"].timestamp()
            yield BlobFile(parsed[0], parsed[1], Path(key), int(meta["size"]), modified)

    def clock_offset(self, *, required: bool = True) -> float:
        """Seconds the store's clock, which stamps ``iter_files``' times, is ahead of this
        host's (``clock_offset``: writes and deletes a probe object, so only GC asks)."""
        return clock_offset(self.store, "blobs", required=required)

    def probe(self) -> None:
        """Write, read back and delete a small object outside the blob layout."""
        key = f".health/{uuid.uuid4().hex}"
        self._call(lambda: obstore.put(self.store, key, b"ok"))
        if self._get(key) != b"ok":
            raise StorageUnavailable("blobs", "the object store returned other bytes")
        self._call(lambda: obstore.delete(self.store, key))

    def _list(self, prefix: str | None, *, offset: str | None = None) -> Iterator[Any]:
        stream = self._call(
            lambda: obstore.list(self.store, prefix=prefix, offset=offset, chunk_size=1000)
        )
        while True:
            try:
                page = self._call(lambda: next(stream))
            except StopIteration:
                return
            yield from page


def _codecs(first: Codec | None) -> tuple[Codec, ...]:
    """Every codec, ``first`` first."""
    if first is None:
        return tuple(SUFFIXES)
    return (first, *(c for c in SUFFIXES if c != first))
