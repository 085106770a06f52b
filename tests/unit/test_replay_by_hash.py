"""A replay compared where a committed blob cannot be read back: the value the batch has in
its place is the blob's only if its bytes hash to the ref (``core.writes._fill_by_hash``)."""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any

from core.blobs.externalize import holds_blob
from core.blobs.store import BLOB_REF_PREFIX, sha256_hex
from core.records import ManifestEntry, StoredEvent
from core.writes import _fill_by_hash

TEXT = "t" * 50
HASH = sha256_hex(TEXT.encode())


def event(payload: dict[str, Any]) -> StoredEvent:
    return StoredEvent("s", 1, 1, "m", payload, datetime.now(UTC))


def test_the_value_in_the_refs_place_is_compared_by_its_hash() -> None:
    stored = {"type": "m", "a": BLOB_REF_PREFIX + HASH}
    manifest = {1: [ManifestEntry("/a", HASH, 50, "utf8")]}
    shown = [dict(stored)]
    assert _fill_by_hash([event(stored)], manifest, {HASH}, shown, [{"type": "m", "a": TEXT}])
    assert shown == [{"type": "m", "a": TEXT}] and stored["a"] == BLOB_REF_PREFIX + HASH
    other = [{"type": "m", "a": "u" * 50}]
    assert not _fill_by_hash([event(stored)], manifest, {HASH}, [dict(stored)], other)
    missing = [{"type": "m"}]
    assert not _fill_by_hash([event(stored)], manifest, {HASH}, [dict(stored)], missing)


def test_a_manifest_entry_whose_place_does_not_hold_its_ref_is_left_as_stored() -> None:
    """The rehydration leaves such a place as stored (and logs it): the comparison must not
    put the batch's value there, which would answer other content as a replay, nor fail on a
    place the payload does not have."""
    stored = {"type": "m", "a": BLOB_REF_PREFIX + HASH, "b": "something else"}
    manifest = {
        1: [
            ManifestEntry("/a", HASH, 50, "utf8"),
            ManifestEntry("/b", HASH, 50, "utf8"),
            ManifestEntry("/x/y", HASH, 50, "utf8"),
        ]
    }
    shown = [dict(stored)]
    sent = [{"type": "m", "a": TEXT, "b": TEXT, "x": {"y": TEXT}}]
    assert _fill_by_hash([event(stored)], manifest, {HASH}, shown, sent)
    assert shown == [{"type": "m", "a": TEXT, "b": "something else"}]


def test_a_blob_holds_only_its_own_value_in_its_encoding() -> None:
    raw = bytes(range(256)) * 4
    b64 = base64.b64encode(raw).decode()
    assert holds_blob(b64, sha256_hex(raw), "base64")
    assert not holds_blob(b64 + "\n", sha256_hex(raw), "base64")  # not canonical base64
    assert not holds_blob(b64, sha256_hex(raw), "utf8")  # the text of it is other bytes
    assert holds_blob(b64, sha256_hex(b64.encode()), "utf8")  # an image kept as a text blob
    assert not holds_blob("a\ud800", sha256_hex(b"a"), "utf8")
    assert not holds_blob(None, HASH, "utf8") and not holds_blob(7, HASH, "utf8")
