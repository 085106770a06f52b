"""Rehydration: put externalized values back where the manifest says they were.

The manifest is authoritative: only its (pointer, hash, encoding) rows are resolved, never
strings that merely look like refs. Two modes:

- exact: every ref becomes the original string (base64 of the bytes, or their UTF-8 text);
- lazy: every ref becomes a ``LazyBlob`` that carries hash and size and reads the blob store
  only when ``load()`` is called, so metadata-only reads never touch the store.

A blob that cannot be read (missing, corrupted, not UTF-8) leaves its ref string in place
and logs session, seq and pointer; the read continues.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any, Literal

import pybase64

from core.blobs.externalize import parse_pointer, value_at_pointer
from core.blobs.store import BLOB_REF_PREFIX, BlobStore, parse_ref
from core.errors import BlobCorrupted, BlobNotFound, InvalidBlobHash
from core.journal import Journal
from core.metrics import metrics
from core.records import BlobEncoding, ManifestEntry, StoredEvent

log = logging.getLogger(__name__)

# False: refs as stored; True: the exact original values; "lazy": LazyBlob values.
RehydrateMode = bool | Literal["lazy"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Where:
    session_id: str
    seq: int
    pointer: str


class VerifiedValues:
    """Decoded values of blobs this process has read and verified, most recent first.

    Keyed by (hash, encoding), bounded by total characters. Only a value decoded from bytes
    that matched their hash (``BlobStore.get``) enters, so a hit serves the blob's content
    and never a corrupt copy; a blob that fails is never cached, and a file corrupted after
    its value was cached is found by the next uncached read or ``blobs verify``. Saves the
    file read, the SHA-256 and the base64 of every image on every rebuild.
    """

    def __init__(self, *, max_chars: int = 64 * 1024 * 1024) -> None:
        self.max_chars = max_chars
        self._values: OrderedDict[tuple[str, BlobEncoding], str] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[str, BlobEncoding]) -> str | None:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key, last=False)
            return value

    def put(self, key: tuple[str, BlobEncoding], value: str) -> None:
        if len(value) > self.max_chars // 4:
            return  # one huge value would evict everything else
        with self._lock:
            if key in self._values:
                return
            self._values[key] = value
            self._values.move_to_end(key, last=False)
            self._chars += len(value)
            while self._chars > self.max_chars:
                _, dropped = self._values.popitem(last=True)
                self._chars -= len(dropped)

    def __contains__(self, key: tuple[str, BlobEncoding]) -> bool:
        with self._lock:
            return key in self._values


READ_AHEAD_THREADS = 8
"""The process's blob-read threads, shared by every rehydration (each keeps at most its
store's ``read_ahead`` reads in flight)."""

READ_AHEAD_BYTES = 64 * 1024 * 1024
"""The most blob bytes one rehydration reads ahead (running, or read and waiting to be
asked for); a blob larger than this alone is never read ahead, only when asked for. With
blobs of up to ``max_blob_bytes`` a window of reads could otherwise hold that many times
as much."""


class _ReadAhead:
    """``BlobStore.get`` of the blobs an exact rehydration will ask for, in that order,
    started in the shared thread pool up to ``window`` ahead of the one being decoded.

    For a store whose read is a round trip (S3: ``read_ahead``), the waits overlap each
    other and the decoding instead of queueing one after another. At most ``window`` reads
    run for one rehydration, and as many read blobs wait at most. ``get`` raises what
    ``BlobStore.get`` raises. A blob whose read has not started (asked for out of order,
    again, or queued behind other rehydrations' reads in the shared pool) is read in the
    caller's thread, so no read waits longer than reading one at a time would. ``close``
    leaves no read running, whatever interrupted the caller.

    ``sizes`` (each blob's, in the order of ``hashes``) bound the bytes read ahead too: at
    most ``max_bytes`` (by default ``READ_AHEAD_BYTES``) running or waiting, and a blob
    larger than that alone is read only when asked for."""

    def __init__(
        self,
        get: Callable[[str], bytes],
        hashes: Sequence[str],
        window: int,
        *,
        sizes: Sequence[int] | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self._get = get
        self._hashes = hashes
        self._order = {h: i for i, h in enumerate(hashes)}
        self._sizes = list(sizes) if sizes is not None else [0] * len(hashes)
        self._max_bytes = READ_AHEAD_BYTES if max_bytes is None else max_bytes
        self._next = 0  # the index of the next hash to start
        self._window = window
        self._pending: dict[str, Future[bytes]] = {}  # started, not yet asked for
        # passed over while running: still counted, with their sizes
        self._skipped: dict[Future[bytes], int] = {}

    def get(self, blob_hash: str) -> bytes:
        index = self._order.get(blob_hash)
        if index is not None:
            # The caller passed the reads before this one (a cached value, a bad pointer):
            # they leave the window, and what was not started yet never is; this one, if
            # not started yet, the caller reads itself.
            for passed in [h for h in self._pending if self._order[h] < index]:
                self._skip(self._pending.pop(passed), self._size(passed))
            self._next = max(self._next, index + 1)
        future = self._pending.pop(blob_hash, None)
        self._top_up()
        if future is None or future.cancel():
            return self._get(blob_hash)
        try:
            return future.result()
        except BaseException:
            # a time limit or an interrupt raised here while it waits
            self._skip(future, self._size(blob_hash))
            raise

    def _size(self, blob_hash: str) -> int:
        return self._sizes[self._order[blob_hash]]

    def _skip(self, future: Future[bytes], size: int) -> None:
        if not future.cancel() and not future.done():
            self._skipped[future] = size

    def _top_up(self) -> None:
        """Start reads in order while fewer than ``window`` run (those started here, and
        passed over, still running, and the one the caller is about to wait for or read)
        and their bytes stay within ``max_bytes``."""
        self._skipped = {f: n for f, n in self._skipped.items() if not f.done()}
        held = sum(self._skipped.values()) + sum(self._size(h) for h in self._pending)
        try:
            while (
                self._next < len(self._hashes)
                and len(self._pending) + len(self._skipped) < self._window - 1
            ):
                blob_hash, size = self._hashes[self._next], self._sizes[self._next]
                if size > self._max_bytes:  # read only when asked for, by the caller
                    self._next += 1
                    continue
                if held + size > self._max_bytes:
                    break
                self._next += 1
                held += size
                self._pending[blob_hash] = _pool().submit(self._get, blob_hash)
        except RuntimeError:  # no thread to be had, or the interpreter is exiting
            log.warning("blob read-ahead unavailable; reading one at a time", exc_info=True)
            self._next = len(self._hashes)

    def close(self) -> None:
        for blob_hash, future in self._pending.items():
            self._skip(future, self._size(blob_hash))
        self._pending.clear()
        wait(self._skipped)
        self._skipped.clear()


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The process's blob-read threads, created on first use (after a fork: anew)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(
                max_workers=READ_AHEAD_THREADS, thread_name_prefix="blob-read"
            )
        return _POOL


def _forget_pool() -> None:
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()  # a forked child has none of the threads


os.register_at_fork(after_in_child=_forget_pool)


def _fetch(
    get: Callable[[str], bytes],
    entry: ManifestEntry,
    where: _Where,
    verified: VerifiedValues | None,
) -> str | None:
    """The original string, or None (logged) when the blob cannot give it back; ``get``
    reads a blob (``BlobStore.get``, or a ``_ReadAhead``'s)."""
    key = (entry.hash, entry.encoding)
    cached = verified.get(key) if verified is not None else None
    if cached is not None:
        return cached
    value = _fetch_verified(get, entry, where)
    if value is not None and verified is not None:
        verified.put(key, value)
    return value


def _fetch_verified(get: Callable[[str], bytes], entry: ManifestEntry, where: _Where) -> str | None:
    extra = {
        "session_id": where.session_id,
        "seq": where.seq,
        "pointer": where.pointer,
        "blob_hash": entry.hash,
    }
    try:
        data = get(entry.hash)
    except BlobNotFound:
        log.warning("blob missing on rehydrate; keeping the ref", extra=extra)
        metrics().rehydrate_misses.labels("missing").inc()
        return None
    except (BlobCorrupted, InvalidBlobHash) as exc:
        log.error("blob unreadable on rehydrate; keeping the ref: %s", exc, extra=extra)
        metrics().rehydrate_misses.labels("corrupt").inc()
        return None
    try:
        return decode_value(data, entry.encoding)
    except UnicodeDecodeError:
        log.error("utf8 blob is not UTF-8; keeping the ref", extra=extra)
        metrics().rehydrate_misses.labels("corrupt").inc()
        return None


def decode_value(data: bytes, encoding: BlobEncoding) -> str:
    if encoding == "base64":
        return pybase64.b64encode_as_string(data)
    return data.decode("utf-8")


class LazyBlob:
    """An externalized value that is read from the blob store on first ``load()``."""

    __slots__ = ("_blobs", "_value", "_verified", "_where", "encoding", "hash", "size")

    def __init__(
        self,
        blobs: BlobStore,
        entry: ManifestEntry,
        where: _Where,
        verified: VerifiedValues | None = None,
    ) -> None:
        self.hash = entry.hash
        self.size = entry.size
        self.encoding: BlobEncoding = entry.encoding
        self._blobs = blobs
        self._where = where
        self._verified = verified
        self._value: str | None = None

    @property
    def ref(self) -> str:
        return BLOB_REF_PREFIX + self.hash

    @property
    def pointer(self) -> str:
        return self._where.pointer

    def load(self) -> str:
        """The original string; the ref string if the blob cannot be read (logged)."""
        if self._value is None:
            entry = ManifestEntry(self._where.pointer, self.hash, self.size, self.encoding)
            self._value = _fetch(self._blobs.get, entry, self._where, self._verified) or self.ref
        return self._value

    def __eq__(self, other: object) -> bool:
        """Same content, decoded the same way; never loads (compare ``load()`` for that)."""
        if not isinstance(other, LazyBlob):
            return NotImplemented
        return (self.hash, self.encoding) == (other.hash, other.encoding)

    def __hash__(self) -> int:
        return hash((self.hash, self.encoding))

    def __repr__(self) -> str:
        return f"LazyBlob(hash={self.hash[:12]}…, size={self.size}, encoding={self.encoding})"


def materialize(value: Any) -> Any:
    """A plain JSON value: every ``LazyBlob`` inside it loaded."""
    if isinstance(value, LazyBlob):
        return value.load()
    if isinstance(value, dict):
        return {k: materialize(v) for k, v in value.items()}
    if isinstance(value, list):
        return [materialize(v) for v in value]
    return value


def as_refs(value: Any) -> Any:
    """A plain JSON value: every ``LazyBlob`` inside it replaced by its ref, as stored (no
    blob is read). The containers are copies."""
    if isinstance(value, LazyBlob):
        return value.ref
    if isinstance(value, dict):
        return {k: as_refs(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_refs(v) for v in value]
    return value


def loaded(value: Any) -> Any:
    """``value``, or the string a ``LazyBlob`` stands for (read on first use)."""
    return value.load() if isinstance(value, LazyBlob) else value


class Rehydrator:
    """Resolves manifest entries against one blob store, with its cache of verified values.

    ``on_read``, if given, is called after each value an exact rehydration resolves (read,
    cached or left a ref): a long build's sign of progress (``core.interop.rehydrated``).
    ``read_ahead``: reads kept in flight (``_ReadAhead``); by default the store's own.
    ``get``: how an exact rehydration reads a blob; by default ``blobs.get``."""

    def __init__(
        self,
        blobs: BlobStore,
        *,
        verified: VerifiedValues | None = None,
        on_read: Callable[[], None] | None = None,
        read_ahead: int | None = None,
        get: Callable[[str], bytes] | None = None,
    ) -> None:
        self.blobs = blobs
        self._get = get
        self.verified = verified if verified is not None else VerifiedValues()
        self.on_read = on_read
        self.read_ahead = blobs.read_ahead if read_ahead is None else read_ahead

    def get(self, blob_hash: str) -> bytes:
        """A blob's bytes, as an exact rehydration reads them."""
        return self.blobs.get(blob_hash) if self._get is None else self._get(blob_hash)

    def read(
        self, journal: Journal, events: Sequence[StoredEvent], *, lazy: bool = False
    ) -> list[StoredEvent]:
        """``events`` with their externalized values restored from the journal's manifest."""
        if not events:
            return list(events)
        return self.events(events, journal.manifest_of(events), lazy=lazy)

    def loader(self, journal: Journal, mode: RehydrateMode) -> StateLoader | None:
        """What ``state`` rehydrates with, for a ``rehydrate`` mode (None: off)."""
        return StateLoader(self, journal, lazy=mode == "lazy") if mode else None

    def strings(
        self,
        journal: Journal,
        session_id: str,
        refs: Collection[str],
        *,
        pointers: Collection[str],
        upto_seq: int,
    ) -> dict[str, tuple[str, frozenset[str]]]:
        """The originals of these ref strings, for those the session's manifest places at
        one of ``pointers`` by ``upto_seq``: ref -> (the string, the pointers it is at).

        For values read out of their events (the fold's): a string that looks like a ref
        but that no such row places is an ordinary string, and one whose blob cannot be
        read stays a ref (logged). Each blob is read once.
        """
        hashes = {h for ref in refs if (h := parse_ref(ref)) is not None}
        if not hashes:
            return {}
        places: dict[str, set[str]] = {}
        first: dict[str, tuple[ManifestEntry, _Where]] = {}  # what a failed read logs
        rows = journal.blob_places(session_id, hashes, pointers=pointers, upto_seq=upto_seq)
        for seq, entry in rows:
            places.setdefault(entry.hash, set()).add(entry.pointer)
            first.setdefault(entry.hash, (entry, _Where(session_id, seq, entry.pointer)))
        found: dict[str, tuple[str, frozenset[str]]] = {}
        for blob_hash, at in places.items():
            value = _fetch(self.get, *first[blob_hash], self.verified)
            if value is not None:
                found[BLOB_REF_PREFIX + blob_hash] = (value, frozenset(at))
        return found

    def events(
        self,
        events: Sequence[StoredEvent],
        manifest: Mapping[int, Sequence[ManifestEntry]],
        *,
        lazy: bool = False,
    ) -> list[StoredEvent]:
        cache: dict[tuple[str, BlobEncoding], str] = {}
        out: list[StoredEvent] = []
        with self._reading_ahead(events, manifest, lazy=lazy) as ahead:
            for event in events:
                entries = manifest.get(event.position, ())
                if not entries:
                    out.append(event)
                    continue
                payload = self.payload(event, entries, lazy=lazy, cache=cache, ahead=ahead)
                out.append(dataclasses.replace(event, payload=payload))
        return out

    @contextmanager
    def _reading_ahead(
        self,
        events: Sequence[StoredEvent],
        manifest: Mapping[int, Sequence[ManifestEntry]],
        *,
        lazy: bool,
    ) -> Iterator[_ReadAhead | None]:
        """A ``_ReadAhead`` of the blobs this exact rehydration will read (None: lazy, or
        fewer than two to read)."""
        hashes: dict[str, int] = {}
        if not lazy and self.read_ahead > 1:
            for event in events:
                for entry in manifest.get(event.position, ()):
                    if (entry.hash, entry.encoding) not in self.verified:
                        hashes.setdefault(entry.hash, entry.size)
        if len(hashes) < 2:
            yield None
            return
        ahead = _ReadAhead(self.get, list(hashes), self.read_ahead, sizes=list(hashes.values()))
        try:
            yield ahead
        finally:
            ahead.close()

    def payload(
        self,
        event: StoredEvent,
        entries: Sequence[ManifestEntry],
        *,
        lazy: bool = False,
        cache: dict[tuple[str, BlobEncoding], str] | None = None,
        ahead: _ReadAhead | None = None,
    ) -> dict[str, Any]:
        """A rehydrated copy of ``event.payload`` (the stored one is never modified).

        Only the objects and arrays on the way to a ref are copied (shallowly, once each);
        everything else is shared with the stored payload, which is final as decoded.
        """
        payload = dict(event.payload)
        copied = {id(payload)}
        cache = {} if cache is None else cache
        for entry in entries:
            where = _Where(event.session_id, event.seq, entry.pointer)
            if not holds_ref(payload, entry):
                log.error(
                    "manifest pointer does not hold its ref; left as stored",
                    extra={**dataclasses.asdict(where), "blob_hash": entry.hash},
                )
                continue
            if lazy:
                lazy_blob = LazyBlob(self.blobs, entry, where, self.verified)
                _set_copying(payload, entry.pointer, lazy_blob, copied)
                continue
            key = (entry.hash, entry.encoding)
            # Failures are not cached, so every pointer to a missing blob gets its warning.
            if key in cache:
                value: str | None = cache[key]
            else:
                get = ahead.get if ahead is not None else self.get
                value = _fetch(get, entry, where, self.verified)
            if self.on_read is not None:
                self.on_read()
            if value is not None:
                cache[key] = value
                _set_copying(payload, entry.pointer, value, copied)
        return payload


@dataclasses.dataclass(frozen=True, slots=True)
class StateLoader:
    """How ``state`` rehydrates for one journal and mode: the events whose content it shows
    (lazily or exactly), and the strings its fold kept as refs (exactly in either mode: they
    are plain ``str`` fields, and the ids among them are what tool calls pair by)."""

    rehydrator: Rehydrator
    journal: Journal
    lazy: bool

    def events(self, events: list[StoredEvent]) -> list[StoredEvent]:
        return self.rehydrator.read(self.journal, events, lazy=self.lazy)

    def strings(
        self, session_id: str, refs: Collection[str], *, pointers: Collection[str], upto_seq: int
    ) -> dict[str, tuple[str, frozenset[str]]]:
        return self.rehydrator.strings(
            self.journal, session_id, refs, pointers=pointers, upto_seq=upto_seq
        )


def _set_copying(root: dict[str, Any], pointer: str, value: Any, copied: set[int]) -> None:
    """Set the value at ``pointer``, first copying each container on the way not yet copied.

    ``copied`` holds the ids of the containers that are already this payload's own (they
    stay referenced from ``root``, so their ids are not reused meanwhile).
    """
    *parents, last = parse_pointer(pointer)
    target: Any = root
    for token in parents:
        key: Any = int(token) if isinstance(target, list) else token
        child = target[key]
        if id(child) not in copied:
            child = child.copy()
            copied.add(id(child))
            target[key] = child
        target = child
    if isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value


def holds_ref(payload: Any, entry: ManifestEntry) -> bool:
    """Whether ``payload`` holds ``entry``'s ref where the entry places it."""
    return bool(value_at_pointer(payload, entry.pointer) == BLOB_REF_PREFIX + entry.hash)
