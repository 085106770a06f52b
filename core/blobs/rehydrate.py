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

import base64
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import orjson

from core.blobs.externalize import parse_pointer, set_at_pointer
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


def _fetch(blobs: BlobStore, entry: ManifestEntry, where: _Where) -> str | None:
    """The original string, or None (logged) when the blob cannot give it back."""
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
        return base64.b64encode(data).decode("ascii")
    return data.decode("utf-8")


class LazyBlob:
    """An externalized value that is read from the blob store on first ``load()``."""

    __slots__ = ("_blobs", "_value", "_where", "encoding", "hash", "size")

    def __init__(self, blobs: BlobStore, entry: ManifestEntry, where: _Where) -> None:
        self.hash = entry.hash
        self.size = entry.size
        self.encoding: BlobEncoding = entry.encoding
        self._blobs = blobs
        self._where = where
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
            self._value = _fetch(self._blobs, entry, self._where) or self.ref
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


class Rehydrator:
    """Resolves manifest entries against one blob store; caches blobs for one call."""

    def __init__(self, blobs: BlobStore) -> None:
        self.blobs = blobs

    def read(
        self, journal: Journal, events: Sequence[StoredEvent], *, lazy: bool = False
    ) -> list[StoredEvent]:
        """``events`` with their externalized values restored from the journal's manifest."""
        if not events:
            return list(events)
        return self.events(events, journal.manifest([e.position for e in events]), lazy=lazy)

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
        """A rehydrated copy of ``event.payload`` (the stored one is never modified)."""
        payload: dict[str, Any] = orjson.loads(orjson.dumps(event.payload))
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
                set_at_pointer(payload, entry.pointer, LazyBlob(self.blobs, entry, where))
                continue
            key = (entry.hash, entry.encoding)
            # Failures are not cached, so every pointer to a missing blob gets its warning.
            value = cache[key] if key in cache else _fetch(self.blobs, entry, where)
            if value is not None:
                cache[key] = value
                set_at_pointer(payload, entry.pointer, value)
        return payload


def _holds_ref(payload: Any, entry: ManifestEntry) -> bool:
    target = payload
    try:
        for token in parse_pointer(entry.pointer):
            target = target[int(token)] if isinstance(target, list) else target[token]
    except (KeyError, IndexError, ValueError, TypeError):
        return False
    return bool(target == BLOB_REF_PREFIX + entry.hash)
