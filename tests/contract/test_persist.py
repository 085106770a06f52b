"""The persistence pipeline, every rule at its boundaries, on each journal backend."""

from __future__ import annotations

import base64
import copy
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from psycopg.errors import DeadlockDetected
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from core import InvalidEvent, SessionStore, Settings
from core.blobs.externalize import TRANSIENT_FIELDS, canonical_base64
from core.blobs.files import FileBlobStore
from core.blobs.store import BLOB_REF_PREFIX, StagedPuts, make_ref, parse_ref, sha256_hex
from core.db import write_transaction
from core.errors import (
    BlobCorrupted,
    BlobNotFound,
    BlobsMissing,
    ConcurrencyConflict,
    IdempotencyKeyReused,
    StorageUnavailable,
)
from core.models import BlobRefRow, BlobRow, EventRow
from core.records import ManifestEntry, StoredEvent

PNG = b"\x89PNG\r\n\x1a\n"


def image_b64(chars: int) -> str:
    """Canonical base64 of exactly ``chars`` characters (a multiple of 4)."""
    assert chars % 4 == 0
    text = base64.b64encode(PNG + os.urandom(chars * 3 // 4 - len(PNG))).decode()
    assert len(text) == chars
    return text


def image(data: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "image", "data": data, "mimeType": "image/png", **extra}


def user(*content: Any) -> dict[str, Any]:
    return {"type": "message", "message": {"role": "user", "content": list(content)}}


def count(store: SessionStore, table: Any) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


class Appended:
    """One appended event: its stored payload and its manifest."""

    def __init__(self, store: SessionStore, event: dict[str, Any]) -> None:
        session = store.create_session(tenant_id="acme")
        result = store.append(session.id, [event])
        [self.stored] = store.read(session.id)
        self.payload = self.stored.payload
        self.refs: list[ManifestEntry] = store.journal.manifest(result.positions).get(
            result.positions[0], []
        )
        [self.rehydrated] = store.read(session.id, rehydrate=True)

    def by_pointer(self) -> dict[str, ManifestEntry]:
        return {r.pointer: r for r in self.refs}


@pytest.fixture
def put(store: SessionStore) -> Iterator[Any]:
    def appended(event: dict[str, Any]) -> Appended:
        return Appended(store, event)

    yield appended


def strip_transient(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: strip_transient(v) for k, v in value.items() if k not in TRANSIENT_FIELDS}
    if isinstance(value, list):
        return [strip_transient(v) for v in value]
    return value


# image blocks ---------------------------------------------------------------------------


def test_image_base64_boundary_1023_vs_1024(put: Any) -> None:
    below = "A" * 1023  # not even valid base64, and below the threshold: inline
    at = image_b64(1024)
    got = put(user(image(below), image(at)))
    content = got.payload["message"]["content"]
    assert content[0]["data"] == below
    assert parse_ref(content[1]["data"]) is not None
    [ref] = got.refs
    assert ref == ManifestEntry("/message/content/1/data", ref.hash, 768, "base64")
    assert ref.hash == sha256_hex(base64.b64decode(at))  # the decoded bytes are the blob
    assert got.rehydrated.payload == user(image(below), image(at))


def test_image_threshold_is_the_setting(tmp_path: Path, database_url: str) -> None:
    settings = Settings(
        data_dir=tmp_path / "d", database_url=database_url, image_min_base64_chars=1028
    )
    with SessionStore.from_settings(settings) as store:
        got = Appended(store, user(image(image_b64(1024)), image(image_b64(1028))))
    assert [r.pointer for r in got.refs] == ["/message/content/1/data"]


@pytest.mark.parametrize(
    "data",
    [
        "AAA=" + image_b64(1020),  # padding in the middle
        image_b64(1024)[:-4] + "AB==",  # non-zero padding bits: decodes, re-encodes differently
        "!" * 1024,
        image_b64(1020) + "\n\n\n\n",
        "é" * 1024,
    ],
)
def test_non_canonical_image_data_is_stored_as_utf8(put: Any, data: str) -> None:
    assert canonical_base64(data) is None
    got = put(user(image(data)))
    [ref] = got.refs
    assert (ref.encoding, ref.size) == ("utf8", len(data.encode()))
    assert got.rehydrated.payload == user(image(data))


def test_image_blocks_in_nested_content_arrays_and_images(put: Any) -> None:
    a, b, c = image_b64(2048), image_b64(1024), image_b64(1536)
    event = {
        "type": "message",
        "message": {
            "role": "toolResult",
            "content": [
                {"type": "tool_result", "content": [{"type": "text", "text": "x"}, image(a)]},
                {"type": "wrapper", "inner": {"deeper": {"images": [image(b)]}}},
            ],
        },
        "images": [image(c)],
    }
    got = put(event)
    assert set(got.by_pointer()) == {
        "/message/content/0/content/1/data",
        "/message/content/1/inner/deeper/images/0/data",
        "/images/0/data",
    }
    assert {r.encoding for r in got.refs} == {"base64"}
    assert got.rehydrated.payload == event


def test_images_under_other_keys_or_shapes_are_untouched(put: Any) -> None:
    data = image_b64(4096)  # big enough for an image, below the 16 KiB string limit
    event = {
        "type": "message",
        "attachments": [image(data)],
        "content": {"type": "image", "data": data},  # an object, not an array
        "message": {
            "content": [
                {"type": "picture", "data": data},  # not type == "image"
                image({"nested": data}),  # data is not a string
                [image(data)],  # an array item that is an array
            ]
        },
    }
    got = put(event)
    assert got.refs == []
    assert got.payload == event


# data URLs ------------------------------------------------------------------------------


def test_image_data_urls_become_blobs_whatever_their_size(put: Any) -> None:
    tiny = "data:image/png;base64,AAAA"
    big = "data:image/jpeg;base64," + image_b64(40_000)
    event = {"type": "custom", "image_url": tiny, "deep": [{"image_url": big}]}
    got = put(event)
    refs = got.by_pointer()
    assert set(refs) == {"/image_url", "/deep/0/image_url"}
    assert refs["/image_url"].hash == sha256_hex(tiny.encode())
    assert refs["/image_url"].encoding == "utf8"
    assert got.rehydrated.payload == event


@pytest.mark.parametrize(
    "value",
    [
        "data:text/plain;base64,aGVsbG8=",
        "data:application/pdf;base64,JVBERi0=",
        "data:image/svg+xml,<svg/>",  # no ;base64,
        "DATA:IMAGE/PNG;BASE64,AAAA",
        "https://example.com/cat.png",
        "xdata:image/png;base64,AAAA",
    ],
)
def test_other_data_urls_are_untouched(put: Any, value: str) -> None:
    event = {"type": "custom", "image_url": value}
    got = put(event)
    assert (got.refs, got.payload) == ([], event)


def test_data_url_under_another_key_is_untouched(put: Any) -> None:
    event = {"type": "custom", "image_url": {"url": "data:image/png;base64,AAAA"}}
    got = put(event)
    assert (got.refs, got.payload) == ([], event)


# large strings --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "externalized"),
    [
        ("a" * 16_384, False),
        ("a" * 16_385, True),
        ("😀" * 4096, False),  # 16,384 UTF-8 bytes in 4,096 characters
        ("😀" * 4096 + "a", True),
        ("é" * 8192, False),
        ("é" * 8191 + "aa", False),
        ("é" * 8192 + "a", True),
    ],
)
def test_large_string_limit_counts_utf8_bytes(put: Any, text: str, externalized: bool) -> None:
    event = {"type": "message", "message": {"role": "assistant", "content": [text]}}
    got = put(event)
    assert bool(got.refs) is externalized
    if externalized:
        assert got.refs == [
            ManifestEntry(
                "/message/content/0", sha256_hex(text.encode()), len(text.encode()), "utf8"
            )
        ]
    assert got.rehydrated.payload == event


def test_large_strings_anywhere_no_truncation_no_cleared_fields(put: Any) -> None:
    big = "x" * 20_000
    event = {
        "type": "message",
        "message": {
            "role": "assistant",
            "content": [{"type": "thinking", "thinking": big, "thinkingSignature": big + "sig"}],
        },
        "details": {"stdout": [big, "small"]},
        "a/b~c": big,
    }
    got = put(event)
    assert set(got.by_pointer()) == {
        "/message/content/0/thinking",
        "/message/content/0/thinkingSignature",
        "/details/stdout/0",
        "/a~1b~0c",  # RFC 6901 escaping
    }
    assert got.payload["details"]["stdout"][1] == "small"
    assert got.rehydrated.payload == event


# NUL strings ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["\x00", "a\x00b", "é\x00" * 3, "\x00" * 20_000])
def test_nul_strings_become_blobs_whatever_their_size(put: Any, text: str) -> None:
    event = {"type": "custom", "data": {"stdout": text, "list": ["ok", text]}}
    got = put(event)
    assert set(got.by_pointer()) == {"/data/stdout", "/data/list/1"}
    assert "\x00" not in repr(got.payload)
    assert got.rehydrated.payload == event


def test_short_image_data_with_nul_is_a_utf8_blob(put: Any) -> None:
    got = put(user(image("abc\x00")))
    assert [(r.pointer, r.encoding) for r in got.refs] == [("/message/content/0/data", "utf8")]


# transient fields -----------------------------------------------------------------------


def test_transient_fields_are_dropped_at_any_depth_and_nothing_else(put: Any) -> None:
    event = {
        "type": "message",
        "partialJson": '{"a":',
        "jsonlEvents": ["x"],
        "message": {
            "role": "assistant",
            "content": [
                {"type": "toolCall", "arguments": {"x": 1}, "partialJson": '{"x":'},
                [[{"deep": {"jsonlEvents": [1, 2], "keep": None}}]],
            ],
        },
        "partialjson": "kept (different case)",
        "partialJsonX": "kept",
        "note": "partialJson",
        "list": ["partialJson", {"jsonlEvents": {"partialJson": 1}}],
        "empty": {},
        "zero": 0,
        "false": False,
        "none": None,
        "float": 1.5,
    }
    original = copy.deepcopy(event)
    got = put(event)
    assert event == original  # the caller's object is not modified
    assert got.payload == strip_transient(event)
    assert got.payload["message"]["content"][0] == {"type": "toolCall", "arguments": {"x": 1}}
    assert got.payload["list"] == ["partialJson", {}]
    assert got.rehydrated.payload == strip_transient(event)


# refs in the input ----------------------------------------------------------------------


def test_a_ref_to_a_stored_blob_is_kept_and_recorded(store: SessionStore, put: Any) -> None:
    raw = PNG + os.urandom(2000)
    # the tenant's own earlier write carried the bytes (refs are scoped by tenant)
    put(user(image(base64.b64encode(raw).decode())))
    h = sha256_hex(raw)
    got = put(user(image(make_ref(h))))
    assert got.payload == user(image(make_ref(h)))
    assert got.refs == [ManifestEntry("/message/content/0/data", h, len(raw), "base64")]
    # The ref stood for the image: rehydration gives its base64.
    expected = user(image(base64.b64encode(raw).decode()))
    assert got.rehydrated.payload == expected


def test_a_ref_to_a_missing_blob_is_invalid_and_nothing_is_written(
    store: SessionStore,
) -> None:
    session = store.create_session(tenant_id="acme")
    missing = sha256_hex(b"never stored")
    events = [user(image(image_b64(2048))), user(image(make_ref(missing)), "x" * 20_000)]
    with pytest.raises(InvalidEvent) as caught:
        store.append(session.id, events)
    assert caught.value.index == 1
    assert caught.value.field == "/message/content/0/data"
    assert missing in caught.value.reason
    assert store.get_session(session.id).head_seq == 0
    assert count(store, BlobRow) == 0  # checked before any blob of the batch was put
    assert isinstance(store.blobs, FileBlobStore) and not store.blobs.root.exists()


@pytest.mark.parametrize(
    "bad",
    [
        BLOB_REF_PREFIX + "../../x",
        BLOB_REF_PREFIX + "A" * 64,
        BLOB_REF_PREFIX + "a" * 63,
        BLOB_REF_PREFIX + "a" * 65,
    ],
)
def test_malformed_refs_in_image_data_never_reach_the_filesystem(
    store: SessionStore, bad: str
) -> None:
    session = store.create_session(tenant_id="acme")
    with pytest.raises(InvalidEvent, match="malformed blob ref") as caught:
        store.append(session.id, [user(image(bad))])
    assert caught.value.field == "/message/content/0/data"
    assert isinstance(store.blobs, FileBlobStore) and not store.blobs.root.exists()


def test_strings_that_merely_look_like_refs_are_left_alone(store: SessionStore, put: Any) -> None:
    stored = store.blobs.put(b"real content").hash
    event = {
        "type": "message",
        "message": {"role": "user", "content": [{"type": "text", "text": make_ref(stored)}]},
        "note": make_ref(sha256_hex(b"missing")),
        "bad": BLOB_REF_PREFIX + "../../etc/passwd",
    }
    got = put(event)
    assert got.refs == []
    assert got.payload == event
    assert got.rehydrated.payload == event  # the manifest, not the string, decides


# manifest, dedup, stats -----------------------------------------------------------------


def test_manifest_rows_are_written_with_the_event(store: SessionStore) -> None:
    session = store.create_session(tenant_id="acme")
    result = store.append(
        session.id, [user("small"), user(image(image_b64(1024)), "y" * 17_000), user("z")]
    )
    with store.engine.connect() as conn:
        refs = BlobRefRow.__table__.c  # type: ignore[attr-defined]
        rows = conn.execute(select(refs.position, refs.session_id, refs.pointer)).all()
    assert sorted(rows) == [
        (result.positions[1], session.id, "/message/content/0/data"),
        (result.positions[1], session.id, "/message/content/1"),
    ]


def test_identical_content_across_sessions_is_one_blob(store: SessionStore) -> None:
    data = image_b64(8192)
    for _ in range(3):
        session = store.create_session(tenant_id="acme")
        store.append(session.id, [user(image(data), image(data))])
    assert count(store, BlobRow) == 1
    assert count(store, BlobRefRow) == 6
    assert isinstance(store.blobs, FileBlobStore)
    assert len(list(store.blobs.iter_files())) == 1
    stats = store.blob_stats()
    size = len(base64.b64decode(data))
    assert (stats.blob_count, stats.raw_bytes, stats.stored_bytes) == (1, size, size)
    assert stats.referenced_bytes == 6 * size
    assert stats.saved_by_dedup == 5 * size
    assert stats.saved_by_compression == 0


def test_prepare_returns_events_with_their_refs(store: SessionStore) -> None:
    [prepared] = store.prepare([user("t" * 20_000)])
    assert prepared.type == "message"
    assert [r.pointer for r in prepared.refs] == ["/message/content/0"]
    assert prepared.payload["message"]["content"][0] == make_ref(prepared.refs[0].hash)


def test_validation_runs_before_any_blob_is_put(store: SessionStore) -> None:
    session = store.create_session(tenant_id="acme")
    with pytest.raises(InvalidEvent):
        store.append(session.id, [user("x" * 20_000), {"no": "type"}])
    assert count(store, BlobRow) == 0


# blobs collected between the put and the append (invariant 6) --------------------------


def gc_once(store: SessionStore, monkeypatch: pytest.MonkeyPatch, *, times: int = 1) -> list[int]:
    """Before the next ``times`` journal appends, collect every blob (as a racing GC would)."""
    calls: list[int] = []
    real_append = store.journal.append

    def append(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) <= times:
            for f in list(store.blobs.iter_files()):  # type: ignore[attr-defined]
                store.blobs.remove_file(f.hash)
            with store.engine.begin() as conn:
                conn.execute(BlobRow.__table__.delete())  # type: ignore[attr-defined]
        return real_append(*args, **kwargs)

    monkeypatch.setattr(store.journal, "append", append)
    return calls


def test_blobs_gc_took_before_the_append_are_recreated_in_its_transaction(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The batch's blobs are registered by the append's own transaction: a file GC removed
    after staging is written again under the row lock, and the append needs no retry."""
    session = store.create_session(tenant_id="acme")
    event = user(image(image_b64(2048)), "q" * 20_000)
    calls = gc_once(store, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="core.blobs.store"):
        store.append(session.id, [event])
    assert len(calls) == 1
    assert caplog.text.count("blob vanished before registration") == 2
    [back] = store.read(session.id, rehydrate=True)
    assert back.payload == event
    assert count(store, BlobRow) == 2


def test_a_failed_append_registers_none_of_its_blobs(store: SessionStore) -> None:
    """The registration commits with the events or not at all: a conflicting append leaves
    its blob files unregistered (orphans for GC's file sweep), never a row of its own."""
    session = store.create_session(tenant_id="acme")
    with pytest.raises(ConcurrencyConflict):
        store.append(session.id, [user("r" * 20_000)], expected_seq=5)
    assert count(store, BlobRow) == 0
    assert len(list(store.blobs.iter_files())) == 1


def test_an_append_chosen_as_a_deadlock_victim_runs_again_whole(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL may pick the append's transaction as a deadlock victim once its blob rows
    are locked: it rolls back whole and runs again, registering and writing once."""
    session = store.create_session(tenant_id="acme")
    real = store.blobs.register_staged
    calls: list[int] = []

    def register_staged(conn: Any, puts: StagedPuts) -> Any:
        calls.append(1)
        results = real(conn, puts)
        if len(calls) == 1:
            raise OperationalError("INSERT INTO blobs", {}, DeadlockDetected("deadlock detected"))
        return results

    monkeypatch.setattr(store.blobs, "register_staged", register_staged)
    event = user("d" * 20_000)
    got = store.append(session.id, [event])
    assert len(calls) == 2
    assert (got.first_seq, got.last_seq) == (1, 1)
    [back] = store.read(session.id, rehydrate=True)
    assert back.payload == event
    assert count(store, BlobRow) == 1 and count(store, EventRow) == 1


def registered_while_staging(store: SessionStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage as a backend that registers in its own transaction does (objects on
    PostgreSQL): then GC can take a blob between that commit and the append."""
    real = store.blobs.stage_many

    def stage_many(items: Any) -> StagedPuts:
        puts = real(items)
        with write_transaction(store.engine) as conn:
            store.blobs.register_staged(conn, puts)
        puts.registered = True
        return puts

    monkeypatch.setattr(store.blobs, "stage_many", stage_many)


def test_append_reputs_blobs_gc_took_and_retries(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    registered_while_staging(store, monkeypatch)
    session = store.create_session(tenant_id="acme")
    event = user(image(image_b64(2048)), "q" * 20_000)
    calls = gc_once(store, monkeypatch)
    store.append(session.id, [event])
    assert len(calls) == 2
    [back] = store.read(session.id, rehydrate=True)
    assert back.payload == event
    assert count(store, BlobRow) == 2


def test_append_retries_are_bounded(store: SessionStore, monkeypatch: pytest.MonkeyPatch) -> None:
    registered_while_staging(store, monkeypatch)
    session = store.create_session(tenant_id="acme")
    calls = gc_once(store, monkeypatch, times=100)
    with pytest.raises(BlobsMissing):
        store.append(session.id, [user("q" * 20_000)])
    assert len(calls) == 3
    assert count(store, EventRow) == 0


def test_input_ref_collected_before_the_append_is_invalid(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = store.create_session(tenant_id="acme")
    raw = PNG + b"producer's image" + bytes(2000)
    store.append(session.id, [user(image(base64.b64encode(raw).decode()))])
    h = sha256_hex(raw)
    gc_once(store, monkeypatch)
    with pytest.raises(InvalidEvent) as caught:
        store.append(session.id, [user(image(make_ref(h)))])
    assert caught.value.field == "/message/content/0/data"
    assert count(store, EventRow) == 1  # only the write that carried the bytes


def test_replayed_write_puts_no_blobs(store: SessionStore, monkeypatch: pytest.MonkeyPatch) -> None:
    session = store.create_session(tenant_id="acme")
    first = store.append(session.id, [user("w" * 20_000)], idempotency_key="k1")
    puts: list[int] = []
    # the write path stages its blobs (``stage_many``); a re-put would use ``put_many``
    for name in ("put_many", "stage_many"):
        monkeypatch.setattr(store.blobs, name, lambda items: puts.append(len(items)))
    again = store.append(session.id, [user("w" * 20_000)], idempotency_key="k1")
    assert again.replayed and again.positions == first.positions
    assert puts == []


@pytest.mark.parametrize("path", ["checked first", "answered by the append"])
def test_a_key_reused_for_other_blobs_is_refused_and_puts_none(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """A batch with blobs is checked against its key before any put (a replay must not
    put again); one without is answered by the append: both compare the content."""
    session = store.create_session(tenant_id="acme")
    shot, other_shot = image_b64(8_000), image_b64(8_000)
    first = store.append(session.id, [user(image(shot))], idempotency_key="k")
    blobs = count(store, BlobRow)
    puts: list[int] = []

    def counted(real: Any) -> Any:
        return lambda items: puts.append(len(items)) if items else real(items)

    for name in ("put_many", "stage_many"):
        monkeypatch.setattr(store.blobs, name, counted(getattr(store.blobs, name)))
    if path == "checked first":  # other bytes under the key: the pre-check compares refs
        with pytest.raises(IdempotencyKeyReused):
            store.append(session.id, [user(image(other_shot))], idempotency_key="k")
        assert puts == []
    else:  # no blob to put: the append finds the key, then the content is compared
        with pytest.raises(IdempotencyKeyReused):
            store.append(session.id, [user("no image")], idempotency_key="k")
    # the same bytes under the key are the same write, even sent as a ref now
    assert store.append(session.id, [user(image(shot))], idempotency_key="k").replayed
    ref = make_ref(sha256_hex(base64.b64decode(shot)))
    assert store.append(session.id, [user(image(ref))], idempotency_key="k").replayed
    assert puts == [] and count(store, BlobRow) == blobs
    assert count(store, EventRow) == 1 and first.last_seq == 1


@pytest.mark.parametrize(
    ("override", "shot"),
    [
        ({"inline_string_limit": 100_000}, 8_000),
        ({"image_min_base64_chars": 100_000}, 8_000),
        ({"image_min_base64_chars": 100_000}, 40_000),  # a UTF-8 blob now, base64 before
    ],
    ids=["text kept inline now", "image kept inline now", "image as text blob now"],
)
def test_a_replay_stored_under_other_settings_now_is_still_a_replay(
    store: SessionStore, settings: Settings, override: dict[str, int], shot: int
) -> None:
    """The first send externalized a value that the replay's settings store otherwise (a
    worker on a new configuration takes a redelivery): inline, or as a blob of another
    encoding. The same write, not IdempotencyKeyReused; anything else different is still
    refused."""
    session = store.create_session(tenant_id="acme")
    events = [user("w" * 20_000, image(image_b64(shot)))]
    first = store.append(session.id, events, idempotency_key="k")
    with SessionStore.from_settings(settings.model_copy(update=override)) as other:
        again = other.append(session.id, events, idempotency_key="k")
        assert again.replayed and again.positions == first.positions
        changed = [user("w" * 20_000, image(image_b64(8_000)))]  # another image
        with pytest.raises(IdempotencyKeyReused):
            other.append(session.id, changed, idempotency_key="k")
    assert count(store, EventRow) == 1


@pytest.mark.parametrize("damage", ["lost", "corrupted"])
def test_a_replay_compared_with_a_blob_damaged_since_is_never_refused_falsely(
    store: SessionStore, settings: Settings, damage: str
) -> None:
    """The replay of a write stored under other settings is compared as sent, which reads
    the committed blobs back. One lost or corrupted since is read from the batch if the
    batch carries its bytes, else compared by its hash: a replay is still a replay, other
    content still refused. A producer's ref to it cannot be read: its typed error."""
    session = store.create_session(tenant_id="acme")
    text, shot = "w" * 20_000, image_b64(8_000)
    first = store.append(session.id, [user(text, image(shot))], idempotency_key="k")
    text_hash = sha256_hex(text.encode())
    image_hash = sha256_hex(base64.b64decode(shot))

    def spoil(blob_hash: str) -> None:
        if damage == "lost":
            store.blobs.remove_file(blob_hash)
            assert not store.blobs.has_stored(blob_hash)
        else:
            found = store.blobs._find(blob_hash)
            assert found is not None
            store.blobs._write(blob_hash, found[0], b"not the blob")

    inline_text = settings.model_copy(update={"inline_string_limit": 100_000})
    with SessionStore.from_settings(inline_text) as other:  # stored JSON differs now
        spoil(image_hash)  # the batch carries the image's bytes
        again = other.append(session.id, [user(text, image(shot))], idempotency_key="k")
        assert again.replayed and again.positions == first.positions
        spoil(text_hash)  # inline in the batch now: compared by its hash
        again = other.append(session.id, [user(text, image(shot))], idempotency_key="k")
        assert again.replayed and again.positions == first.positions
        for changed in (
            [user("W" * 20_000, image(shot))],  # another text where the lost one was
            [user(text, image(image_b64(8_000)))],  # another image where the lost one was
            [user(text, image(shot), "more")],  # the same where they were, more elsewhere
            [user(image(shot), text)],  # a structure the lost values could not fill
        ):
            with pytest.raises(IdempotencyKeyReused):
                other.append(session.id, changed, idempotency_key="k")
        error = BlobNotFound if damage == "lost" else BlobCorrupted
        spoil(image_hash)  # the first replay put it back (its bytes were in the batch)
        with pytest.raises(error) as caught:
            other.append(session.id, [user(text, image(make_ref(image_hash)))], idempotency_key="k")
        assert caught.value.blob_hash == image_hash
    assert count(store, EventRow) == 1


@pytest.mark.parametrize("damage", ["lost", "corrupted"])
def test_a_replay_puts_back_the_blobs_it_carries_that_the_store_lost(
    store: SessionStore, settings: Settings, damage: str
) -> None:
    """A blob lost or damaged since the write committed is restored from a replay that
    carries its bytes (a redelivery, a producer's retry), as a re-put of the content is
    (invariant 13): the session reads whole again. A carried blob nothing references is not
    stored; an intact store is only checked; a store that cannot be checked now does not
    fail the replay's answer."""
    session = store.create_session(tenant_id="acme")
    text, shot = "w" * 20_000, image_b64(8_000)
    events = [user(text, image(shot))]
    first = store.append(session.id, events, idempotency_key="k")
    hashes = [sha256_hex(text.encode()), sha256_hex(base64.b64decode(shot))]
    for blob_hash in hashes:
        if damage == "lost":
            assert store.blobs.remove_file(blob_hash)
        else:
            found = store.blobs._find(blob_hash)
            assert found is not None
            store.blobs._write(blob_hash, found[0], b"not the blob")
        with pytest.raises(BlobNotFound if damage == "lost" else BlobCorrupted):
            store.blobs.get(blob_hash)
    again = store.append(session.id, events, idempotency_key="k")
    assert again.replayed and again.positions == first.positions
    assert [store.blobs.get(h) for h in hashes] == [text.encode(), base64.b64decode(shot)]
    assert [e.payload for e in store.read(session.id, rehydrate=True)] == events
    assert count(store, EventRow) == 1

    # carried, unreferenced (the committed write holds the value inline): not stored
    inline = settings.model_copy(update={"inline_string_limit": 100_000})
    with SessionStore.from_settings(inline) as other:
        other.append(session.id, [user("v" * 20_000)], idempotency_key="i")
    blobs = count(store, BlobRow)
    assert store.append(session.id, [user("v" * 20_000)], idempotency_key="i").replayed
    assert count(store, BlobRow) == blobs and not store.blobs.has_stored(sha256_hex(b"v" * 20_000))


def test_a_replay_is_answered_when_its_blobs_cannot_be_checked(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = store.create_session(tenant_id="acme")
    events = [user("w" * 20_000)]
    first = store.append(session.id, events, idempotency_key="k")

    def unavailable(blob_hash: str) -> bool:
        raise StorageUnavailable("blobs", "the object store is down")

    monkeypatch.setattr(store.blobs, "has_stored", unavailable)
    again = store.append(session.id, events, idempotency_key="k")
    assert again.replayed and again.positions == first.positions


@pytest.mark.parametrize(
    ("first", "then"),
    [
        ("hello", make_ref(sha256_hex(b"hello"))),  # a literal ref-shaped text
        ("<svg/>" * 300, base64.b64encode(b"<svg/>" * 300).decode()),  # text, then base64
        ("w" * 20_000, "W" * 20_000),  # two blobs
    ],
    ids=["literal ref", "text vs its base64", "other blob"],
)
def test_other_content_that_only_hashes_alike_is_not_a_replay(
    store: SessionStore, first: str, then: str
) -> None:
    """A value is the same only as sent: a text that happens to be the ref of the value
    stored, or the base64 of it, is other content (answering it as a replay would lose
    it)."""
    session = store.create_session(tenant_id="acme")
    store.append(session.id, [user(first)], idempotency_key="k")
    with pytest.raises(IdempotencyKeyReused):
        store.append(session.id, [user(then)], idempotency_key="k")
    shot = image_b64(8_000)
    store.append(session.id, [user(image(shot))], idempotency_key="i")
    as_text = [user(image(base64.b64decode(shot).decode("latin-1")))]
    with pytest.raises(IdempotencyKeyReused):
        store.append(session.id, as_text, idempotency_key="i")


def test_a_replay_that_differs_only_in_transient_fields_is_a_replay(store: SessionStore) -> None:
    session = store.create_session(tenant_id="acme")
    first = store.append(session.id, [{**user("hi"), "partialJson": '{"a":'}], idempotency_key="k")
    again = store.append(session.id, [{**user("hi"), "partialJson": "{}"}], idempotency_key="k")
    assert again.replayed and again.positions == first.positions


def test_stored_event_is_a_plain_record(store: SessionStore) -> None:
    session = store.create_session(tenant_id="acme")
    store.append(session.id, [user("v" * 20_000)])
    [event] = store.read(session.id)
    assert isinstance(event, StoredEvent)
    assert parse_ref(event.payload["message"]["content"][0]) is not None
