"""Invariant 9: a blob ref sent without its bytes is scoped by the session's tenant."""

from __future__ import annotations

import base64
import os
import re
from typing import Any

import pytest

from core import SessionStore
from core.blobs.store import make_ref, sha256_hex
from core.errors import InvalidEvent

PNG = b"\x89PNG\r\n\x1a\n"


def image_event(data: str) -> dict[str, Any]:
    block = {"type": "image", "data": data, "mimeType": "image/png"}
    return {"type": "message", "message": {"role": "user", "content": [block]}}


def refused(store: SessionStore, session_id: str, blob_hash: str) -> InvalidEvent:
    with pytest.raises(InvalidEvent) as caught:
        store.append(session_id, [image_event(make_ref(blob_hash))])
    return caught.value


def shape(error: InvalidEvent, blob_hash: str) -> dict[str, Any]:
    """The error with the hash taken out: what a caller can tell the two cases apart by."""
    as_dict = error.to_dict()
    return {k: re.sub(blob_hash, "<hash>", str(v)) for k, v in as_dict.items()}


def test_another_tenants_blob_is_refused_exactly_like_a_nonexistent_one(
    store: SessionStore,
) -> None:
    raw = PNG + os.urandom(4000)
    a_hash = sha256_hex(raw)
    a = store.create_session(tenant_id="tenant-a")
    store.append(a.id, [image_event(base64.b64encode(raw).decode())])
    assert store.blobs.exists(a_hash)
    b = store.create_session(tenant_id="tenant-b")
    nowhere = sha256_hex(PNG + os.urandom(4000))
    before = store.blobs.info(a_hash)

    theirs = refused(store, b.id, a_hash)
    never = refused(store, b.id, nowhere)

    assert type(theirs) is type(never)
    assert shape(theirs, a_hash) == shape(never, nowhere)
    assert store.get_session(b.id).head_seq == 0
    after = store.blobs.info(a_hash)
    assert before is not None and after is not None
    assert after.last_written_at == before.last_written_at  # B did not even refresh it

    # tenant A's own other session may reference it without the bytes
    a2 = store.create_session(tenant_id="tenant-a")
    store.append(a2.id, [image_event(make_ref(a_hash))])
    [back] = store.read(a2.id, rehydrate=True)
    assert back.payload["message"]["content"][0]["data"] == base64.b64encode(raw).decode()


def test_a_ref_whose_bytes_come_with_the_write_is_accepted(store: SessionStore) -> None:
    raw = PNG + os.urandom(4000)
    session = store.create_session(tenant_id="tenant-c")
    events = [image_event(base64.b64encode(raw).decode()), image_event(make_ref(sha256_hex(raw)))]
    store.append(session.id, events)
    back = store.read(session.id, rehydrate=True)
    assert [e.payload for e in back] == [events[0], events[0]]


def test_a_stored_but_unreferenced_blob_is_refused(store: SessionStore) -> None:
    raw = PNG + os.urandom(4000)
    blob_hash = store.blobs.put(raw).hash  # stored by someone, referenced by nobody
    session = store.create_session(tenant_id="tenant-d")
    error = refused(store, session.id, blob_hash)
    assert error.field == "/message/content/0/data"
    assert blob_hash in error.reason and "not stored" in error.reason
