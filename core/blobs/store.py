"""Content-addressed blob store: the ``blobs`` registry table plus a storage backend.

A blob is addressed by the SHA-256 of its raw bytes. The filesystem backend keeps it at
``<root>/<h[0:2]>/<h[2:4]>/<hash>.blob.gz`` (gzip) or ``<hash>.blob`` (identity, for media
that is already compressed or data that gzip shrinks by under 10%).

Invariants 2 and 6 (DESIGN.md) shape ``put``: the file is written durably (temporary file,
fsync, rename, directory fsync), and then, inside ONE write transaction, the ``blobs`` row is
upserted first (taking its row lock, refreshing ``last_written_at``) and the file is checked
again and re-created if GC removed it meanwhile. GC removes a file only while it holds that
row's lock (``remove_file``), so once a put commits, its blob is registered and on disk.

Invariant 9: only a 64-character lowercase hex string is ever turned into a path.
"""

from __future__ import annotations

import hashlib
import logging
import re
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import Connection, Engine, exists, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from core.blobs.digests import StoredDigests
from core.db import is_sqlite, read_connection, retry_deadlocks, write_transaction
from core.errors import BlobCorrupted, BlobLinked, BlobNotFound, InvalidBlobHash
from core.metrics import metrics
from core.models import (
    BlobRefRow,
    BlobRow,
    SessionRow,
    database_clock,
    postgres_statement_clock,
    table_of,
    utcnow,
)
from core.records import PlainRecord
from core.translate import translated

log = logging.getLogger(__name__)

BLOB_REF_PREFIX = "blob:sha256:"
_HASH_RE = re.compile(r"[0-9a-f]{64}")

Codec = Literal["gzip", "identity"]
SUFFIXES: dict[Codec, str] = {"gzip": ".blob.gz", "identity": ".blob"}
# A blob file GC has moved aside under its row lock, until the row delete commits.
QUARANTINE_SUFFIX = ".gc"
# Where ``blobs verify`` moves corrupt files (under the blob root), named
# ``<blob file name>.<CORRUPT_STAMP>``.
CORRUPT_DIR = "corrupt"
CORRUPT_STAMP = "%Y%m%dT%H%M%S%f"
_STAMPED_RE = re.compile(r"(.+)\.[0-9]{8}T[0-9]{12}")
# Compression must save at least this share of the bytes to be worth a decode on every read.
MIN_COMPRESSION_SAVING = 0.10
DEFAULT_GZIP_LEVEL = 6
_MEDIA_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a")
_GZIP_WBITS = 31  # zlib container = gzip, with a zero mtime so output is deterministic

_blobs = table_of(BlobRow)
_refs = table_of(BlobRefRow)


# hashes and refs ------------------------------------------------------------------------


def is_valid_hash(value: object) -> bool:
    """True only for a 64-character lowercase hex string."""
    return isinstance(value, str) and _HASH_RE.fullmatch(value) is not None


def check_hash(value: str) -> str:
    if not is_valid_hash(value):
        raise InvalidBlobHash(str(value))
    return value


def make_ref(blob_hash: str) -> str:
    return BLOB_REF_PREFIX + check_hash(blob_hash)


def looks_like_ref(value: object) -> bool:
    """Has the ref prefix; says nothing about whether the rest is a valid hash."""
    return isinstance(value, str) and value.startswith(BLOB_REF_PREFIX)


def parse_ref(value: object) -> str | None:
    """The hash of a well-formed ``blob:sha256:<64 lowercase hex>`` string, else None."""
    if not looks_like_ref(value):
        return None
    candidate = str(value)[len(BLOB_REF_PREFIX) :]
    return candidate if is_valid_hash(candidate) else None


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# codecs ---------------------------------------------------------------------------------


def is_media(data: bytes) -> bool:
    """PNG, JPEG, GIF or WebP: already compressed, so gzip would only cost time."""
    if data.startswith(_MEDIA_MAGIC):
        return True
    return data[:4] == b"RIFF" and data[8:12] == b"WEBP"


def encode_blob(data: bytes, *, level: int = DEFAULT_GZIP_LEVEL) -> tuple[Codec, bytes]:
    if is_media(data):
        return "identity", data
    compressed = zlib.compress(data, level, wbits=_GZIP_WBITS)
    if len(compressed) > len(data) * (1 - MIN_COMPRESSION_SAVING):
        return "identity", data
    return "gzip", compressed


def decode_blob(codec: Codec, stored: bytes) -> bytes:
    """The content of stored bytes; ``zlib.error`` unless they are whole gzip members and
    nothing else (``zlib.decompress`` ignores bytes after the first member: a damaged file
    too). This store writes one member; several, as ``cat a.gz b.gz`` makes, are valid gzip
    (RFC 1952) and decode to their concatenation, as every gzip reader does."""
    if codec == "identity":
        return stored
    parts: list[bytes] = []
    rest = stored
    while True:
        inflater = zlib.decompressobj(wbits=_GZIP_WBITS)
        try:
            parts.append(inflater.decompress(rest))
            if not inflater.eof:
                raise zlib.error("incomplete or truncated stream")
        except zlib.error as exc:
            if not parts:
                raise
            raise zlib.error(f"{len(rest)} bytes after the end of the stream: {exc}") from None
        rest = inflater.unused_data
        if not rest:
            return parts[0] if len(parts) == 1 else b"".join(parts)


STREAM_CHUNK = 256 * 1024  # stored bytes read at a time, and most content inflated at once


class StreamDecoder:
    """``decode_blob``, a chunk of stored bytes at a time: the content comes out in pieces of
    at most ``limit`` bytes (``max_length``: a megabyte of gzip can hold a gigabyte of
    zeros), so memory stays bounded whatever the ratio. The rules are ``decode_blob``'s:
    whole gzip members, any number of them back to back, nothing after; ``finish`` raises
    ``zlib.error`` for a stream that ends inside a member (or holds none)."""

    def __init__(self, codec: Codec, *, limit: int = STREAM_CHUNK) -> None:
        self.codec = codec
        self.limit = limit
        self._inflater: Any = None  # the member being inflated; None between members
        self._members = 0

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The content ``data`` completes, in pieces of at most ``limit`` bytes."""
        if self.codec == "identity":
            for start in range(0, len(data), self.limit):
                yield data[start : start + self.limit]
            return
        while True:
            if self._inflater is None:
                if not data:
                    return
                self._inflater = zlib.decompressobj(wbits=_GZIP_WBITS)
            out = self._inflater.decompress(data, self.limit)
            if out:
                yield out
            if self._inflater.eof:
                self._members += 1
                data = self._inflater.unused_data  # a next member, or bytes after the end
                self._inflater = None
                continue
            data = self._inflater.unconsumed_tail
            if not data and len(out) < self.limit:
                return  # everything fed is inflated; with a full piece, more may be pending

    def finish(self) -> None:
        if self.codec == "gzip" and (self._inflater is not None or self._members == 0):
            raise zlib.error("incomplete or truncated stream")


# records --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PutResult:
    hash: str
    size: int
    stored_size: int
    codec: Codec
    written: bool  # False when the content was already stored (a re-put)

    @property
    def ref(self) -> str:
        return BLOB_REF_PREFIX + self.hash


@dataclass(frozen=True, slots=True)
class BlobInfo:
    hash: str
    size: int
    stored_size: int
    codec: str
    created_at: datetime
    last_written_at: datetime


@dataclass(frozen=True, slots=True)
class BlobFile:
    """A blob file found on disk, registered or not (for the orphan sweep)."""

    hash: str
    codec: Codec
    path: Path
    stored_size: int
    modified_at: float


@dataclass(frozen=True, slots=True)
class BlobStats(PlainRecord):
    blob_count: int
    raw_bytes: int  # sum of the blobs' uncompressed sizes, each blob once
    stored_bytes: int  # what the blobs occupy in the store
    referenced_bytes: int  # what the journal's refs stand for, counting every reference
    saved_by_dedup: int
    saved_by_compression: int


@dataclass(frozen=True, slots=True)
class _Stored:
    """How one blob is (or is about to be) stored; ``payload`` only if this put encoded it."""

    codec: Codec
    stored_size: int
    payload: bytes | None
    written: bool


@dataclass
class StagedPuts:
    """Blobs stored durably (``stage_many``), to be registered in one transaction.

    ``registered``: a backend that registers while it stores (objects on PostgreSQL) has
    already committed the rows, and ``final`` is set."""

    hashes: list[str]  # per item, in order (duplicates included)
    unique: dict[str, bytes]
    staged: dict[str, _Stored]
    registered: bool = False
    final: dict[str, _Stored] | None = field(default=None, repr=False)

    def results(self) -> list[PutResult]:
        final = self.final if self.final is not None else self.staged
        results = []
        for h in self.hashes:
            stored = final[h]
            results.append(
                PutResult(h, len(self.unique[h]), stored.stored_size, stored.codec, stored.written)
            )
        return results


# the registry table ---------------------------------------------------------------------


class BlobIndex:
    """SQL for the ``blobs`` table, shared by every storage backend."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._upsert = _upsert_statement(engine)

    def upsert(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
        """Register or refresh rows, taking their row locks in hash order."""
        if rows:
            conn.execute(self._upsert, sorted(rows, key=lambda r: str(r["hash"])))

    def refresh(
        self, conn: Connection, hashes: Sequence[str], *, tenant_id: str | None = None
    ) -> dict[str, int]:
        """Refresh ``last_written_at`` of registered blobs; return their sizes by hash.

        With ``tenant_id``, only blobs some session of that tenant already references count
        (invariant 9): one statement per hash whether or not the blob exists, so the answer
        for another tenant's blob is the answer for a blob that was never stored.
        """
        found: dict[str, int] = {}
        for blob_hash in sorted(set(hashes)):  # one row at a time, in hash order: no deadlock
            query = update(_blobs).where(_blobs.c.hash == blob_hash)
            if tenant_id is not None:
                query = query.where(_referenced_by_tenant(tenant_id))
            row = conn.execute(
                query.values(last_written_at=database_clock(self.engine)).returning(_blobs.c.size)
            ).first()
            if row is not None:
                found[blob_hash] = int(row.size)
        return found

    def lock(self, conn: Connection, blob_hash: str) -> bool:
        """Take the row's lock in the caller's write transaction (``FOR UPDATE``; SQLite's
        write transaction already excludes every writer); whether the row exists."""
        query = select(_blobs.c.hash).where(_blobs.c.hash == blob_hash)
        if not is_sqlite(self.engine):
            query = query.with_for_update()
        return conn.execute(query).first() is not None

    def registered(self, blob_hash: str) -> bool:
        with read_connection(self.engine) as conn:
            query = select(_blobs.c.hash).where(_blobs.c.hash == blob_hash)
            return conn.execute(query).first() is not None

    def codec_of(self, blob_hash: str) -> str | None:
        """The registered codec, in one round trip: a single read needs no transaction
        (BEGIN and COMMIT would be two more; a read's path is this lookup plus one GET)."""
        with self.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            codec = conn.execute(
                select(_blobs.c.codec).where(_blobs.c.hash == blob_hash)
            ).scalar_one_or_none()
        return None if codec is None else str(codec)

    def info(self, blob_hash: str) -> BlobInfo | None:
        with read_connection(self.engine) as conn:
            row = conn.execute(select(_blobs).where(_blobs.c.hash == blob_hash)).first()
        if row is None:
            return None
        return BlobInfo(
            row.hash, row.size, row.stored_size, row.codec, row.created_at, row.last_written_at
        )

    def stats(self) -> BlobStats:
        referenced = exists().where(_refs.c.hash == _blobs.c.hash)
        with read_connection(self.engine) as conn:
            count, raw, stored = conn.execute(
                select(
                    func.count(),
                    func.coalesce(func.sum(_blobs.c.size), 0),
                    func.coalesce(func.sum(_blobs.c.stored_size), 0),
                )
            ).one()
            ref_bytes = conn.execute(select(func.coalesce(func.sum(_refs.c.size), 0))).scalar()
            unique_ref_bytes = conn.execute(
                select(func.coalesce(func.sum(_blobs.c.size), 0)).where(referenced)
            ).scalar()
        return BlobStats(
            blob_count=int(count),
            raw_bytes=int(raw),
            stored_bytes=int(stored),
            referenced_bytes=int(ref_bytes or 0),
            saved_by_dedup=max(0, int(ref_bytes or 0) - int(unique_ref_bytes or 0)),
            saved_by_compression=int(raw) - int(stored),
        )


def _referenced_by_tenant(tenant_id: str) -> Any:
    sessions = table_of(SessionRow)
    return exists().where(
        _refs.c.hash == _blobs.c.hash,
        _refs.c.session_id == sessions.c.id,
        sessions.c.tenant_id == tenant_id,
    )


def _upsert_statement(engine: Engine) -> Any:
    # Built once: one cached statement, run with a parameter list (no per-call compile).
    # The times are the database's clock on PostgreSQL (the rows' values are not used): GC
    # on another host judges ``last_written_at`` by that clock, whatever the writer's says.
    insert: Any
    if is_sqlite(engine):
        insert = sqlite_insert(_blobs)
        written: Any = insert.excluded.last_written_at
    else:
        written = postgres_statement_clock()
        insert = pg_insert(_blobs).values(created_at=written, last_written_at=written)
    return insert.on_conflict_do_update(
        index_elements=[_blobs.c.hash],
        set_={
            "last_written_at": written,
            "stored_size": insert.excluded.stored_size,
            "codec": insert.excluded.codec,
        },
    )


# the interface --------------------------------------------------------------------------


class BlobStore(ABC):
    """Content-addressed bytes. Subclasses supply the storage primitives only."""

    read_ahead = 1
    """``get`` calls worth running at once when many blobs are wanted (an exact rehydration:
    ``core.blobs.rehydrate``). One here: a read from local files is mostly the GIL's work,
    and threads made a session's rehydration slower, not faster (bench/RESULTS.md)."""

    remote = False
    """Whether each storage call is a network round trip (seconds, minutes with retries):
    then none is made while SQLite's database-wide write lock is held (``network_outside_lock``)."""

    def __init__(self, index: BlobIndex, *, gzip_level: int = DEFAULT_GZIP_LEVEL) -> None:
        self.index = index
        self.gzip_level = gzip_level
        self.digests = StoredDigests()  # stored bytes this process wrote or verified

    @property
    def network_outside_lock(self) -> bool:
        """A ``remote`` store under SQLite, whose write lock is the whole database's: its
        calls come before the lock's transaction or after its commit, sound by order where
        PostgreSQL holds a row's lock through them (GC's sweep, a put's registration, a
        ref's refresh)."""
        return self.remote and is_sqlite(self.index.engine)

    # storage primitives -----------------------------------------------------------------

    @abstractmethod
    def _find(self, blob_hash: str, first: Codec | None = None) -> tuple[Codec, int] | None:
        """Codec and stored size of the stored object, or None (``first``: the codec to try
        first, when the caller knows it; a lookup per codec costs a round trip on S3)."""

    @abstractmethod
    def _write(self, blob_hash: str, codec: Codec, payload: bytes) -> None:
        """Store durably and atomically: a reader sees all of it or nothing."""

    @abstractmethod
    def _read(self, blob_hash: str) -> tuple[Codec, bytes] | None:
        """The stored (encoded) bytes, unverified, or None."""

    @abstractmethod
    def _open(self, blob_hash: str) -> AbstractContextManager[tuple[Codec, Iterator[bytes]] | None]:
        """The stored (encoded) bytes as ``_read`` finds them, unverified, as a stream of
        chunks of about ``STREAM_CHUNK`` bytes (never the whole object at once); None when
        there is none. The stream is valid inside the ``with`` only."""

    @abstractmethod
    def remove_file(self, blob_hash: str) -> bool:
        """Delete the stored object; True if there was one.

        Only GC calls this, inside the transaction that holds the blob row's FOR UPDATE lock
        and deletes that row, after re-checking it is unreferenced (invariant 6).
        """

    @abstractmethod
    def quarantine_file(self, blob_hash: str) -> list[Path]:
        """Move the stored object aside, for GC under the blob row's lock (on SQLite with a
        ``remote`` store, before a short transaction re-checks the row: ``core.maintenance.gc``).

        GC deletes the row and commits, then ``purge_quarantined``; if the commit fails it
        calls ``restore_quarantined``. A crash in between leaves a quarantined file whose
        row still exists: reads put it back, and the next GC restores or purges it. So a
        registered blob never loses its file for good (invariant 6).
        """

    @abstractmethod
    def purge_quarantined(self, moved: Sequence[Path]) -> None:
        """Delete files ``quarantine_file`` moved aside (after the row delete committed)."""

    @abstractmethod
    def restore_quarantined(self, moved: Sequence[Path]) -> None:
        """Put files ``quarantine_file`` moved aside back in place."""

    @abstractmethod
    def iter_quarantined(self) -> Iterator[tuple[str, Path]]:
        """(hash, path) of every file left quarantined (by a GC that did not finish)."""

    def clock_offset(self, *, required: bool = True) -> float:
        """Seconds the clock that stamps ``iter_files``' times is ahead of this host's: none
        for files on this host's disk (an object store's own, see ``ObjectBlobStore``; not
        ``required``: this host's if it cannot be read)."""
        return 0.0

    @abstractmethod
    def iter_files(self, after: str = "") -> Iterator[BlobFile]:
        """Every stored object, registered or not (temporary files excluded), in key order
        (``<h[0:2]>/<h[2:4]>/<name>``), those past the key ``after``."""

    @abstractmethod
    def _discard_other_codecs(self, blob_hash: str, keep: Codec) -> None:
        """Remove the object stored under any codec but ``keep`` (a replaced bad copy)."""

    @abstractmethod
    def _read_codec(self, blob_hash: str, codec: Codec) -> bytes | None:
        """The bytes stored under ``codec`` (unverified), or None."""

    @abstractmethod
    def _move_corrupt(self, blob_hash: str, codec: Codec, stamp: str) -> str | None:
        """Move the object stored under ``codec`` out of the store, for inspection (to
        ``corrupt/``, its name suffixed with ``.<stamp>``); where it went, None if absent."""

    # the API ----------------------------------------------------------------------------

    def put(self, data: bytes) -> PutResult:
        return self.put_many([data])[0]

    @translated
    def put_many(self, items: Sequence[bytes]) -> list[PutResult]:
        """Store each item (identical content once) and register all in one transaction."""
        if not items:
            return []
        puts = self.stage_many(items)
        if not puts.registered:
            puts.final = retry_deadlocks(lambda: self._register(puts.unique, puts.staged))
        results = puts.results()
        count_puts(results)
        return results

    @translated
    def stage_many(self, items: Sequence[bytes]) -> StagedPuts:
        """Store each item durably, registering none yet: ``register_staged`` does, inside
        the transaction that commits the events referencing them (invariant 2: registered
        no later than the reference commits; one commit per append instead of two)."""
        hashes, unique = by_hash(items)
        return StagedPuts(hashes, unique, self._stage_all(unique))

    def register_staged(self, conn: Connection, puts: StagedPuts) -> list[PutResult]:
        """Register staged blobs in the caller's write transaction: their row locks (hash
        order), then each object re-checked and re-created if GC took it meanwhile. The
        results count (``count_puts``) once that transaction has committed."""
        if not puts.registered:
            puts.final = self._register_in(conn, puts.unique, puts.staged)
        return puts.results()

    @translated
    def get(self, blob_hash: str) -> bytes:
        """The verified content; ``BlobCorrupted`` rather than wrong bytes."""
        check_hash(blob_hash)
        found = self._read(blob_hash)
        if found is None:
            raise BlobNotFound(blob_hash)
        codec, stored = found
        try:
            data = decode_blob(codec, stored)
        except zlib.error as exc:
            raise BlobCorrupted(blob_hash, f"cannot decode {codec} data: {exc}") from exc
        if sha256_hex(data) != blob_hash:
            raise BlobCorrupted(blob_hash, "content does not match its hash")
        return data

    @translated
    def peek(self, blob_hash: str, limit: int) -> bytes:
        """The first ``limit`` bytes of the verified content, read in bounded memory: the
        stored object streams through (``_open``), inflated a piece at a time, and only
        those bytes are kept. It is verified to its end all the same, before anything is
        returned (invariant 13: showing the start of a blob whose tail is damaged would
        serve it), so ``BlobCorrupted`` as ``get`` raises it, and ``BlobNotFound``.

        The stored digests (``StoredDigests``) are used as ``check_stored`` uses them: when
        this process verified the blob's stored bytes before, the rest of them is only
        hashed (no inflate) and compared; a full check verifies the content and records the
        stored digest. Memory: a stored chunk and a piece of content at a time, whatever
        the blob's size."""
        check_hash(blob_hash)
        if self.digests.has(blob_hash):
            head = self._peek(blob_hash, limit, known_digest=True)
            if head is not None:
                return head
        head = self._peek(blob_hash, limit, known_digest=False)
        assert head is not None  # a full check returns or raises
        return head

    def _peek(self, blob_hash: str, limit: int, *, known_digest: bool) -> bytes | None:
        """``peek``'s pass over the stored stream. ``known_digest``: stop inflating once the
        head is read and prove it by the stored digest recorded for the blob; None when the
        stored bytes are no longer those (the full pass then decides)."""
        with self._open(blob_hash) as found:
            if found is None:
                raise BlobNotFound(blob_hash)
            codec, chunks = found
            shortcut = known_digest and codec == "gzip"
            decoder = StreamDecoder(codec)
            stored_digest = hashlib.sha256()
            content_digest = hashlib.sha256()
            size = 0
            head = bytearray()
            try:
                for chunk in chunks:
                    stored_digest.update(chunk)
                    if shortcut and len(head) >= limit:
                        continue  # the head is read: the rest is only hashed
                    for piece in decoder.feed(chunk):
                        if len(head) < limit:
                            head += piece[: limit - len(head)]
                        content_digest.update(piece)
                        size += len(piece)
                if shortcut:
                    if self.digests.matches_digest(blob_hash, codec, stored_digest.digest()):
                        return bytes(head)
                    return None
                decoder.finish()
            except zlib.error as exc:
                if shortcut:
                    return None
                raise BlobCorrupted(blob_hash, f"cannot decode {codec} data: {exc}") from exc
        if content_digest.hexdigest() != blob_hash:
            raise BlobCorrupted(blob_hash, "content does not match its hash")
        self.digests.record_digest(blob_hash, codec, stored_digest.digest(), size)
        return bytes(head)

    def exists(self, blob_hash: str) -> bool:
        """Registered in the ``blobs`` table and present in storage."""
        check_hash(blob_hash)
        return self._find(blob_hash) is not None and self.index.registered(blob_hash)

    def has_stored(self, blob_hash: str) -> bool:
        """Whether the storage holds an object for the hash (registered or not, unverified)."""
        return self._find(check_hash(blob_hash)) is not None

    def info(self, blob_hash: str) -> BlobInfo | None:
        return self.index.info(check_hash(blob_hash))

    def refresh(self, hashes: Iterable[str], *, tenant_id: str | None = None) -> dict[str, int]:
        """Refresh ``last_written_at`` of stored blobs, as a re-put would; sizes by hash.

        Hashes that are unregistered or whose object is gone are left out of the result, and
        so, with ``tenant_id``, are blobs no session of that tenant references.
        """
        wanted = [check_hash(h) for h in hashes]
        if not wanted:
            return {}
        with write_transaction(self.index.engine) as conn:
            sizes = self.index.refresh(conn, wanted, tenant_id=tenant_id)
            if not self.network_outside_lock:
                return self._stored_among(sizes)
        return self._stored_among(sizes)  # once the refresh has committed

    def _stored_among(self, sizes: dict[str, int]) -> dict[str, int]:
        return {h: size for h, size in sizes.items() if self._find(h) is not None}

    def stats(self) -> BlobStats:
        return self.index.stats()

    # put internals ----------------------------------------------------------------------

    def _stage_all(self, unique: dict[str, bytes]) -> dict[str, _Stored]:
        """Encode and durably write each blob, before any transaction: the database write
        lock is never held through compression and fsync."""
        return {h: self._stage(h, data) for h, data in unique.items()}

    def _stage(self, blob_hash: str, data: bytes, first: Codec | None = None) -> _Stored:
        kept = self._kept(blob_hash, data, first)
        return kept if kept is not None else self._replace(blob_hash, data)

    def _kept(self, blob_hash: str, data: bytes, first: Codec | None = None) -> _Stored | None:
        """The stored object, if there is one and it holds this content (verified)."""
        found = self._find(blob_hash, first)
        if found is None:
            return None
        try:
            problem = self.check_stored(blob_hash, len(data))
        except BlobLinked as exc:  # a link in its place: the new file is renamed over it
            problem = str(exc)
        if problem is None:
            return _Stored(found[0], found[1], None, written=False)
        # Invariant 13: a re-put of the content repairs a damaged file, never trusts it.
        log.warning(
            "stored blob is corrupt; replacing it from the put's content",
            extra={"blob_hash": blob_hash, "problem": problem},
        )
        return None

    def _replace(self, blob_hash: str, data: bytes) -> _Stored:
        """Write the content atomically, then drop a stale file stored under another codec."""
        codec, payload = encode_blob(data, level=self.gzip_level)
        self._write(blob_hash, codec, payload)
        self.digests.record(blob_hash, codec, payload, len(data))
        self._discard_other_codecs(blob_hash, codec)
        return _Stored(codec, len(payload), payload, written=True)

    def check_stored(self, blob_hash: str, size: int | None = None) -> str | None:
        """Why the stored object is not this blob (None when it is, or is absent)."""
        found = self._read(blob_hash)
        if found is None:
            return None
        return self._problem(blob_hash, *found, size)

    def quarantine_corrupt(self, blob_hash: str, size: int) -> list[str]:
        """Move each stored object of the hash that does not hold its content out of the
        store (``_move_corrupt``); where they went.

        Under the blob row's lock (the one a put registers under, and GC deletes under),
        each object is checked again first: one a concurrent put repaired after the caller's
        check is left in place, and so is a good copy under the other codec. Nothing moves
        once the row is gone (GC's orphan sweep owns an unregistered object)."""
        stamp = utcnow().strftime(CORRUPT_STAMP)
        moved: list[str] = []
        with write_transaction(self.index.engine) as conn:
            if not self.index.lock(conn, blob_hash):
                return moved
            for codec in SUFFIXES:
                stored = self._read_codec(blob_hash, codec)
                if stored is None or self._problem(blob_hash, codec, stored, size) is None:
                    continue
                aside = self._move_corrupt(blob_hash, codec, stamp)
                if aside is not None:
                    moved.append(aside)
        return moved

    def _problem(self, blob_hash: str, codec: Codec, stored: bytes, size: int | None) -> str | None:
        """Why ``stored`` (under ``codec``) is not this blob; None when it is.

        The cheap check first: a stored identity file, or decoded content, of the wrong
        size; the stored bytes against the digest this process recorded of them
        (``StoredDigests``); only then the hash of the decoded content.
        """
        if codec == "identity" and size is not None and len(stored) != size:
            return f"stored size {len(stored)} != content size {size}"
        if self.digests.matches(blob_hash, codec, stored, size):
            return None
        try:
            data = decode_blob(codec, stored)
        except zlib.error as exc:
            return f"cannot decode {codec} data: {exc}"
        if size is not None and len(data) != size:
            return f"decoded size {len(data)} != content size {size}"
        if sha256_hex(data) != blob_hash:
            return "content does not match its hash"
        self.digests.record(blob_hash, codec, stored, len(data))
        return None

    def _register(self, unique: dict[str, bytes], staged: dict[str, _Stored]) -> dict[str, _Stored]:
        with write_transaction(self.index.engine) as conn:
            return self._register_in(conn, unique, staged)

    def _register_in(
        self, conn: Connection, unique: dict[str, bytes], staged: dict[str, _Stored]
    ) -> dict[str, _Stored]:
        """Row locks first, then make sure every object exists (invariant 6); the caller
        commits."""
        now = utcnow()
        self.index.upsert(conn, rows_of(unique, staged, now))
        final, changed = self._ensure_all(unique, staged, now)
        if changed:
            self.index.upsert(conn, changed)
        return final

    def _ensure_all(
        self, unique: dict[str, bytes], staged: dict[str, _Stored], now: datetime
    ) -> tuple[dict[str, _Stored], list[dict[str, Any]]]:
        """Every object checked, in hash order, and re-created if it is gone; and the rows
        of those re-created, which must describe the new object."""
        final = {h: self._ensure(h, unique[h], staged[h]) for h in sorted(staged)}
        recreated = {h: s for h, s in final.items() if s is not staged[h]}
        return final, rows_of(unique, recreated, now)

    def _ensure(self, blob_hash: str, data: bytes, staged: _Stored) -> _Stored:
        if self._find(blob_hash, staged.codec) is not None:
            return staged
        # GC removed the object between our write and our row lock: write it again.
        log.warning(
            "blob vanished before registration; re-creating", extra={"blob_hash": blob_hash}
        )
        if staged.payload is None:
            return self._replace(blob_hash, data)
        self._write(blob_hash, staged.codec, staged.payload)
        self.digests.record(blob_hash, staged.codec, staged.payload, len(data))
        return _Stored(staged.codec, len(staged.payload), staged.payload, written=True)


def by_hash(items: Sequence[bytes]) -> tuple[list[str], dict[str, bytes]]:
    """Each item's hash, in order, and the distinct contents by hash.

    Each item is copied once and that copy is both hashed and kept: a caller's
    ``bytearray`` changed by another thread between two copies would otherwise store
    one content under the other's hash.
    """
    contents = [bytes(data) for data in items]
    hashes = [sha256_hex(data) for data in contents]
    return hashes, dict(zip(hashes, contents, strict=True))


def count_puts(results: Sequence[PutResult]) -> None:
    """Bytes written anew, and bytes a put found already stored (dedup), for the metrics."""
    written: set[str] = set()
    new = dedup = 0
    for r in results:
        if r.written and r.hash not in written:
            written.add(r.hash)
            new += r.size
        else:
            dedup += r.size
    observed = metrics()
    observed.blob_bytes_put.inc(new)
    observed.blob_bytes_deduplicated.inc(dedup)


def rows_of(
    unique: dict[str, bytes], stored: dict[str, _Stored], now: datetime
) -> list[dict[str, Any]]:
    """The ``blobs`` rows of stored contents (hash order is ``BlobIndex.upsert``'s)."""
    return [
        {
            "hash": blob_hash,
            "size": len(unique[blob_hash]),
            "stored_size": item.stored_size,
            "codec": item.codec,
            "created_at": now,
            "last_written_at": now,
        }
        for blob_hash, item in stored.items()
    ]


# the filesystem backend -----------------------------------------------------------------


def parse_blob_name(name: str, *, stamped: bool = False) -> tuple[str, Codec] | None:
    """(hash, codec) of a blob file's name; None for any other name. ``stamped``: the
    name of a file ``blobs verify`` moved to ``corrupt/`` parses too."""
    unstamped = _STAMPED_RE.fullmatch(name) if stamped else None
    if unstamped is not None:
        name = unstamped[1]
    for codec, suffix in SUFFIXES.items():
        if name.endswith(suffix) and is_valid_hash(name[: -len(suffix)]):
            return name[: -len(suffix)], codec
    return None
