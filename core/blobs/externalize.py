"""The persistence pipeline: strip transient fields and externalize payloads into blobs.

Applied to every event before it reaches the journal (invariant 7, lossless by default):

- image blocks (``type == "image"`` items of arrays under ``content``/``images``, at any
  depth) whose ``data`` has at least ``image_min_base64_chars`` characters become a blob of
  the decoded bytes when re-encoding reproduces the exact string, else a UTF-8 blob;
- a ``data:image/…;base64,…`` string under the key ``image_url`` becomes a UTF-8 blob;
- any other string over ``inline_string_limit`` UTF-8 bytes, or containing U+0000 (which
  PostgreSQL ``jsonb`` cannot hold), becomes a UTF-8 blob;
- ``partialJson`` and ``jsonlEvents`` are dropped at any depth, and nothing else is.

An image block whose ``data`` is already a ref keeps it if the blob is stored (its manifest
row says ``base64``, so rehydration yields the image's base64), and is ``InvalidEvent``
otherwise. Strings that merely look like refs anywhere else are ordinary strings.
"""

from __future__ import annotations

import binascii
import copy
import hashlib
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pybase64

from core import exact_json
from core.blobs.store import (
    BLOB_REF_PREFIX,
    BlobStore,
    StagedPuts,
    looks_like_ref,
    make_ref,
    parse_ref,
    sha256_hex,
)
from core.errors import InvalidEvent
from core.journal.validation import pointer_token
from core.records import BlobEncoding, ManifestEntry, PreparedEvent

TRANSIENT_FIELDS = frozenset({"partialJson", "jsonlEvents"})
IMAGE_ARRAY_KEYS = frozenset({"content", "images"})
DATA_URL_KEY = "image_url"
# An event's compact JSON without any of these (and no string over the inline limit) has
# nothing to strip or externalize: it is stored as it is, without a walk. Image blocks are
# found by their exact `"type":"image"` member; orjson writes keys and ASCII text verbatim.
_WALK_MARKERS = re.compile(
    b"|".join(
        re.escape(marker)
        for marker in (
            *(f'"{name}"'.encode() for name in sorted(TRANSIENT_FIELDS)),
            f'"{DATA_URL_KEY}"'.encode(),
            b'"type":"image"',
        )
    )
)
_UTF8_MAX_BYTES_PER_CHAR = 4


@dataclass(frozen=True, slots=True)
class _Slot:
    """A value to externalize, found by the walk; its ref is filled in after the put."""

    event: int
    pointer: str
    data: bytes
    encoding: BlobEncoding


@dataclass(frozen=True, slots=True)
class InputRef:
    """A ref the producer sent in an image block's ``data``."""

    event: int
    pointer: str
    hash: str


@dataclass(slots=True)
class PersistedBatch:
    """Journal-ready events, plus what ``SessionStore.append`` needs to retry."""

    events: list[PreparedEvent]
    # bytes of every blob this batch put, so a blob GC'd before the append can be re-put
    blobs: dict[str, bytes] = field(default_factory=dict)
    input_refs: list[InputRef] = field(default_factory=list)
    # blobs stored but not yet registered (``Persister.put(register=False)``)
    staged: StagedPuts | None = None

    def input_ref_for(self, hashes: set[str]) -> InputRef | None:
        """The first producer-sent ref among ``hashes`` (those cannot be re-put)."""
        return next((r for r in self.input_refs if r.hash in hashes), None)


# Where a value sits, as a chain of (parent, key) links: rendering a JSON pointer for every
# node of every event would dominate the walk, and only externalized values need one.
_Path = tuple[Any, str | int] | None


def _pointer(path: _Path) -> str:
    tokens: list[str] = []
    while path is not None:
        path, key = path
        tokens.append(pointer_token(key))
    return "".join(f"/{token}" for token in reversed(tokens))


_SCALARS = frozenset({int, float, bool, type(None)})


@dataclass
class PersistPlan:
    """A walked batch: the payloads to store and the values each walker will externalize."""

    events: Sequence[dict[str, Any]]
    walkers: list[_Walker]  # of the walked events only (slots and refs name their event)
    payloads: list[dict[str, Any]]
    # per event: its stored JSON when it needed no walk (the payload is the event itself)
    encoded: list[bytes | None]

    @property
    def puts_blobs(self) -> bool:
        return any(w.slots or w.input_refs for w in self.walkers)

    @property
    def has_input_refs(self) -> bool:
        return any(w.input_refs for w in self.walkers)

    def carried(self) -> dict[str, bytes]:
        """The bytes of every value the batch would externalize, by their hash (the blob a
        ref to that hash names: content-addressed, so these are its bytes)."""
        return {sha256_hex(s.data): s.data for w in self.walkers for s in w.slots}


class _Walker:
    """One pass over one event: builds the stored payload, records what to externalize."""

    def __init__(self, event: int, *, image_min: int, inline_limit: int) -> None:
        self.event = event
        self.image_min = image_min
        self.inline_limit = inline_limit
        self.slots: list[_Slot] = []
        self.input_refs: list[InputRef] = []

    def value(self, value: Any, path: _Path) -> Any:
        kind = type(value)
        if kind in _SCALARS:
            return value
        if isinstance(value, str):
            return self.string(value, path)
        if isinstance(value, dict):
            return self.obj(value, path)
        if isinstance(value, (list, tuple)):
            return [self.value(item, (path, i)) for i, item in enumerate(value)]
        return value

    def obj(
        self, value: dict[str, Any], path: _Path, *, image_block: bool = False
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, item in value.items():
            if key in TRANSIENT_FIELDS:
                continue
            if type(item) in _SCALARS:
                out[key] = item
            elif image_block and key == "data" and isinstance(item, str):
                out[key] = self.image_data(item, (path, key))
            elif key == DATA_URL_KEY and _is_image_data_url(item):
                out[key] = self.externalize(item.encode(), "utf8", (path, key))
            elif key in IMAGE_ARRAY_KEYS and isinstance(item, list):
                child = (path, key)
                out[key] = [self.array_item(x, (child, i)) for i, x in enumerate(item)]
            else:
                out[key] = self.value(item, (path, key))
        return out

    def array_item(self, item: Any, path: _Path) -> Any:
        if isinstance(item, dict) and item.get("type") == "image":
            return self.obj(item, path, image_block=True)
        return self.value(item, path)

    def image_data(self, text: str, path: _Path) -> str:
        if looks_like_ref(text):
            blob_hash = parse_ref(text)
            if blob_hash is None:
                raise InvalidEvent(
                    _pointer(path),
                    f"malformed blob ref: expected {BLOB_REF_PREFIX}<64 lowercase hex>",
                )
            self.input_refs.append(InputRef(self.event, _pointer(path), blob_hash))
            return text
        if len(text) < self.image_min:
            return self.string(text, path)
        raw = canonical_base64(text)
        if raw is None:
            return self.externalize(text.encode(), "utf8", path)
        return self.externalize(raw, "base64", path)

    def string(self, text: str, path: _Path) -> str:
        if "\x00" in text or _utf8_len_exceeds(text, self.inline_limit):
            return self.externalize(text.encode(), "utf8", path)
        return text

    def externalize(self, data: bytes, encoding: BlobEncoding, path: _Path) -> str:
        self.slots.append(_Slot(self.event, _pointer(path), data, encoding))
        return ""  # placeholder until the put returns the hash


def content_digest(events: Sequence[Any]) -> str:
    """A digest of a batch's content, whatever the settings that will store it: what two
    sends of one write share and two writes of other content do not.

    Transient fields are left out, as the journal drops them; every image's bytes and
    every image data URL count as their blob ref (sent as bytes once and as a ref again,
    an image is the same image), whatever their size; every other value as sent, in
    order. Events must have passed validation.
    """
    digest = hashlib.sha256()
    for event in events:
        as_json = exact_json.dumps(event)
        if _WALK_MARKERS.search(as_json) is not None:
            walker = _Walker(0, image_min=0, inline_limit=sys.maxsize)
            payloads = [walker.obj(event, None)]
            _fill_slots(payloads, [walker], _hash_ref)
            as_json = exact_json.dumps(payloads[0])
        digest.update(len(as_json).to_bytes(8, "big") + as_json)
    return digest.hexdigest()[:32]


def _fill_slots(
    payloads: Sequence[dict[str, Any]], walkers: Sequence[_Walker], value: Callable[[_Slot], str]
) -> None:
    """Put ``value(slot)`` in place of every value the walkers took out of ``payloads``."""
    for walker in walkers:
        for slot in walker.slots:
            set_at_pointer(payloads[slot.event], slot.pointer, value(slot))


def _hash_ref(slot: _Slot) -> str:
    """The ref a put of the slot's bytes gives, computed without storing them."""
    return make_ref(sha256_hex(slot.data))


def _sent_value(slot: _Slot) -> str:
    """The value as the producer sent it (what an exact rehydration of its blob gives)."""
    return slot.data.decode() if slot.encoding == "utf8" else _b64(slot.data)


def _b64(data: bytes) -> str:
    return pybase64.b64encode_as_string(data)


def canonical_base64(text: str) -> bytes | None:
    """The decoded bytes, only if encoding them again gives back exactly ``text``.

    That is the definition, checked as written: strict decoding (``validate=True``) refuses
    other alphabets, whitespace and misplaced padding, and encoding again refuses what it
    still lets through (extra padding, a last character with non-zero spare bits).
    ``pybase64`` (SIMD) does both some 40 times faster than the standard library's
    ``base64``; ``tests/unit/test_canonical_base64.py`` holds it to the standard library's
    answer."""
    try:
        raw = pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if pybase64.b64encode_as_string(raw) == text else None


def _is_image_data_url(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("data:image/") and ";base64," in value


def _utf8_len_exceeds(text: str, limit: int) -> bool:
    # Character counts bound the UTF-8 size, which skips encoding nearly every string.
    if len(text) * _UTF8_MAX_BYTES_PER_CHAR <= limit:
        return False
    if len(text) > limit:
        return True
    return len(text.encode()) > limit


def set_at_pointer(document: Any, pointer: str, value: Any) -> None:
    """Replace the value at an RFC 6901 pointer (which must exist) inside ``document``."""
    *parents, last = parse_pointer(pointer)
    target = document
    for token in parents:
        target = target[int(token)] if isinstance(target, list) else target[token]
    if isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value


def value_at_pointer(document: Any, pointer: str) -> Any:
    """The value at an RFC 6901 pointer inside ``document``, or None where there is none."""
    target = document
    try:
        for token in parse_pointer(pointer):
            target = target[int(token)] if isinstance(target, list) else target[token]
    except (KeyError, IndexError, ValueError, TypeError):
        return None
    return target


def holds_blob(value: Any, blob_hash: str, encoding: BlobEncoding) -> bool:
    """Whether ``value`` is what an exact rehydration of the blob ``blob_hash``, stored with
    ``encoding``, gives back (found without reading it: its bytes hash to it)."""
    if not isinstance(value, str):
        return False
    if encoding == "base64":
        raw = canonical_base64(value)
    else:
        try:
            raw = value.encode("utf-8")
        except UnicodeEncodeError:
            return False
    return raw is not None and sha256_hex(raw) == blob_hash


def parse_pointer(pointer: str) -> list[str]:
    if not pointer.startswith("/"):
        raise ValueError(f"not a JSON pointer to a member: {pointer!r}")
    return [t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/")]


class Persister:
    """Turns validated raw events into ``PreparedEvent``s, putting their blobs first."""

    def __init__(
        self, blobs: BlobStore, *, image_min_base64_chars: int, inline_string_limit: int
    ) -> None:
        self.blobs = blobs
        self.image_min = image_min_base64_chars
        self.inline_limit = inline_string_limit

    def persist(
        self,
        events: Sequence[dict[str, Any]],
        encoded: Sequence[bytes | None] | None = None,
        *,
        tenant_id: str | None = None,
    ) -> PersistedBatch:
        """Externalize a batch; nothing is written if a producer-sent ref is bad."""
        return self.put(self.plan(events, encoded), tenant_id=tenant_id)

    def plan(
        self, events: Sequence[dict[str, Any]], encoded: Sequence[bytes | None] | None = None
    ) -> PersistPlan:
        """Walk the batch: what to externalize, without storing anything yet.

        ``encoded``: the events' JSON from validation (``check_batch``), where it has it; an
        event whose JSON shows nothing to strip or externalize is not walked at all.
        """
        walkers, payloads, stored = [], [], []
        for i, event in enumerate(events):
            as_json = encoded[i] if encoded is not None else None
            if as_json is not None and self._nothing_to_do(as_json):
                payloads.append(event)
            else:
                walker, payload = self._walk(i, event)
                walkers.append(walker)
                payloads.append(payload)
                as_json = None
            stored.append(as_json)
        return PersistPlan(events, walkers, payloads, stored)

    def _nothing_to_do(self, as_json: bytes) -> bool:
        # Every string is shorter than the JSON around it, so a small event has no large one.
        if len(as_json) > self.inline_limit:
            return False
        return _WALK_MARKERS.search(as_json) is None

    def put(
        self, plan: PersistPlan, *, tenant_id: str | None = None, register: bool = True
    ) -> PersistedBatch:
        """Store the plan's blobs and put their refs (and manifest entries) in place.

        A producer-sent ref is accepted only when the batch itself carries the bytes, or a
        session of ``tenant_id`` already references the blob (None: no tenant, so neither).
        ``register=False``: the blobs are stored durably but left for the caller to
        register in the transaction that appends the batch (``PersistedBatch.staged``).
        """
        events, payloads = plan.events, plan.payloads
        input_refs = [ref for walker in plan.walkers for ref in walker.input_refs]
        slots = [slot for walker in plan.walkers for slot in walker.slots]
        ref_sizes = self._check_input_refs(input_refs, slots, tenant_id)
        staged: StagedPuts | None = None
        if register or not slots:
            results = self.blobs.put_many([slot.data for slot in slots])
        else:
            staged = self.blobs.stage_many([slot.data for slot in slots])
            results = staged.results()
        refs: list[list[ManifestEntry]] = [[] for _ in events]
        for slot, result in zip(slots, results, strict=True):
            set_at_pointer(payloads[slot.event], slot.pointer, make_ref(result.hash))
            refs[slot.event].append(
                ManifestEntry(slot.pointer, result.hash, result.size, slot.encoding)
            )
        for ref in input_refs:
            refs[ref.event].append(
                ManifestEntry(ref.pointer, ref.hash, ref_sizes[ref.hash], "base64")
            )
        prepared = [
            PreparedEvent(
                type=str(event["type"]), payload=payload, refs=tuple(event_refs), encoded=as_json
            )
            for event, payload, event_refs, as_json in zip(
                events, payloads, refs, plan.encoded, strict=True
            )
        ]
        put = {r.hash: slot.data for slot, r in zip(slots, results, strict=True)}
        return PersistedBatch(prepared, put, input_refs, staged)

    def planned_payloads(self, plan: PersistPlan) -> list[dict[str, Any]]:
        """The payloads ``put`` would store for ``plan``, each ref computed from its bytes'
        hash and nothing stored (to compare a replay with the write it repeats). Fills the
        refs into the plan's own payloads: the plan is not to be put afterwards."""
        _fill_slots(plan.payloads, plan.walkers, _hash_ref)
        return list(plan.payloads)

    def sent_payloads(
        self, plan: PersistPlan, read: Callable[[str], bytes]
    ) -> list[dict[str, Any]]:
        """The payloads of ``plan`` as sent, less transient fields: every value a blob
        holds or would hold put back inline (a producer's image ref read with ``read``),
        as an exact rehydration of what it stores gives back (to compare a replay stored
        under other settings). The plan is left as it was."""
        payloads = [copy.deepcopy(payload) for payload in plan.payloads]
        _fill_slots(payloads, plan.walkers, _sent_value)
        for ref in (ref for walker in plan.walkers for ref in walker.input_refs):
            set_at_pointer(payloads[ref.event], ref.pointer, _b64(read(ref.hash)))
        return payloads

    def _walk(self, index: int, event: dict[str, Any]) -> tuple[_Walker, dict[str, Any]]:
        walker = _Walker(index, image_min=self.image_min, inline_limit=self.inline_limit)
        try:
            return walker, walker.obj(event, None)
        except InvalidEvent as exc:
            raise InvalidEvent(exc.field, exc.reason, index=index) from None

    def _check_input_refs(
        self, input_refs: list[InputRef], slots: list[_Slot], tenant_id: str | None
    ) -> dict[str, int]:
        """Sizes of the referenced blobs, refreshed so GC's grace window starts again."""
        if not input_refs:
            return {}
        carried = {sha256_hex(slot.data): len(slot.data) for slot in slots}
        others = {r.hash for r in input_refs} - carried.keys()
        # A ref without a tenant is looked up nowhere: refused like a blob never stored.
        sizes = self.blobs.refresh(others, tenant_id=tenant_id) if tenant_id is not None else {}
        sizes.update(carried)
        for ref in input_refs:
            if ref.hash not in sizes:
                raise missing_ref_error(ref)
        return sizes


def missing_ref_error(ref: InputRef) -> InvalidEvent:
    return InvalidEvent(
        ref.pointer, f"references blob {ref.hash}, which is not stored", index=ref.event
    )
