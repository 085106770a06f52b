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
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import pybase64

from core.blobs.externalize import parse_pointer
from core.blobs.store import BLOB_REF_PREFIX, BlobStore
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


def _fetch(
    blobs: BlobStore, entry: ManifestEntry, where: _Where, verified: VerifiedValues | None
) -> str | None:
    """The original string, or None (logged) when the blob cannot give it back."""
    key = (entry.hash, entry.encoding)
    cached = verified.get(key) if verified is not None else None
    if cached is not None:
        return cached
    value = _fetch_verified(blobs, entry, where)
    if value is not None and verified is not None:
        verified.put(key, value)
    return value


def _fetch_verified(blobs: BlobStore, entry: ManifestEntry, where: _Where) -> str | None:
    extra = {
        "session_id": where.session_id,
        "seq": where.seq,
        "pointer": where.pointer,
        "blob_hash": entry.hash,
    }
    try:
        data = blobs.get(entry.hash)
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
            self._value = _fetch(self._blobs, entry, self._where, self._verified) or self.ref
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
    cached or left a ref): a long build's sign of progress (``core.interop.rehydrated``)."""

    def __init__(
        self,
        blobs: BlobStore,
        *,
        verified: VerifiedValues | None = None,
        on_read: Callable[[], None] | None = None,
    ) -> None:
        self.blobs = blobs
        self.verified = verified if verified is not None else VerifiedValues()
        self.on_read = on_read

    def read(
        self, journal: Journal, events: Sequence[StoredEvent], *, lazy: bool = False
    ) -> list[StoredEvent]:
        """``events`` with their externalized values restored from the journal's manifest."""
        if not events:
            return list(events)
        return self.events(events, journal.manifest_of(events), lazy=lazy)

    def loader(
        self, journal: Journal, mode: RehydrateMode
    ) -> Callable[[list[StoredEvent]], list[StoredEvent]] | None:
        """What ``state`` calls on the events it shows, for a ``rehydrate`` mode (None: off)."""
        if not mode:
            return None

        def load(events: list[StoredEvent]) -> list[StoredEvent]:
            return self.read(journal, events, lazy=mode == "lazy")

        return load

    def events(
        self,
        events: Sequence[StoredEvent],
        manifest: Mapping[int, Sequence[ManifestEntry]],
        *,
        lazy: bool = False,
    ) -> list[StoredEvent]:
        cache: dict[tuple[str, BlobEncoding], str] = {}
        out: list[StoredEvent] = []
        for event in events:
            entries = manifest.get(event.position, ())
            if not entries:
                out.append(event)
                continue
            payload = self.payload(event, entries, lazy=lazy, cache=cache)
            out.append(dataclasses.replace(event, payload=payload))
        return out

    def payload(
        self,
        event: StoredEvent,
        entries: Sequence[ManifestEntry],
        *,
        lazy: bool = False,
        cache: dict[tuple[str, BlobEncoding], str] | None = None,
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
            if not _holds_ref(payload, entry):
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
            value = cache[key] if key in cache else _fetch(self.blobs, entry, where, self.verified)
            if self.on_read is not None:
                self.on_read()
            if value is not None:
                cache[key] = value
                _set_copying(payload, entry.pointer, value, copied)
        return payload


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


def _holds_ref(payload: Any, entry: ManifestEntry) -> bool:
    target = payload
    try:
        for token in parse_pointer(entry.pointer):
            target = target[int(token)] if isinstance(target, list) else target[token]
    except (KeyError, IndexError, ValueError, TypeError):
        return False
    return bool(target == BLOB_REF_PREFIX + entry.hash)
