"""Rehydration: exact, lazy, and tolerant of missing blobs; a hypothesis round trip."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core import SessionStore, Settings
from core.blobs.externalize import TRANSIENT_FIELDS
from core.blobs.files import FileBlobStore
from core.blobs.rehydrate import LazyBlob, materialize
from core.blobs.store import make_ref, sha256_hex

PNG = b"\x89PNG\r\n\x1a\n"
IMAGE_MIN = 64
INLINE_LIMIT = 256


def canonical(value: Any) -> bytes:
    """Byte-level identity that ignores key order (PostgreSQL jsonb does not keep it)."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def strip_transient(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: strip_transient(v) for k, v in value.items() if k not in TRANSIENT_FIELDS}
    if isinstance(value, list):
        return [strip_transient(v) for v in value]
    return value


# strategies: sessions with images, data URLs, large and NUL strings, nested content --------

texts = st.text(st.characters(codec="utf-8"), max_size=40)
large_texts = st.builds(
    lambda unit, n: unit * n,  # around the UTF-8 byte limit for 1- to 4-byte characters
    st.sampled_from(["a", "é", "€", "😀"]),
    st.integers(min_value=INLINE_LIMIT // 4 - 2, max_value=INLINE_LIMIT + 2),
)
nul_texts = st.builds(lambda a, b: f"{a}\x00{b}", texts, texts)
image_bytes = st.builds(lambda tail: PNG + tail, st.binary(min_size=30, max_size=600))
image_data = st.one_of(
    image_bytes.map(lambda b: base64.b64encode(b).decode()),  # canonical: a base64 blob
    image_bytes.map(lambda b: base64.b64encode(b).decode() + "\n"),  # not canonical: utf8
    st.text(alphabet="ABCD+/=", min_size=IMAGE_MIN - 2, max_size=IMAGE_MIN + 2),
)
data_urls = st.builds(
    lambda kind, b: f"data:{kind};base64,{base64.b64encode(b).decode()}",
    st.sampled_from(["image/png", "image/webp", "text/plain", "application/json"]),
    st.binary(max_size=100),
)
image_blocks = st.fixed_dictionaries(
    {"type": st.just("image"), "data": image_data},
    optional={"mimeType": st.just("image/png"), "partialJson": texts},
)
scalars = st.one_of(
    texts, large_texts, nul_texts, st.integers(-(2**53), 2**53), st.booleans(), st.none()
)
keys = st.one_of(
    st.sampled_from(["text", "a/b", "m~n", "image_url", "partialJson", "jsonlEvents", "x"]),
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=8),
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(keys, children, max_size=4),
        st.fixed_dictionaries({"content": st.lists(st.one_of(image_blocks, children), max_size=3)}),
        st.fixed_dictionaries({"images": st.lists(image_blocks, max_size=2)}),
        st.fixed_dictionaries({"image_url": data_urls}),
    )


json_values = st.recursive(scalars, _containers, max_leaves=12)
events = st.builds(
    lambda kind, body: {**body, "type": kind},
    st.sampled_from(["message", "custom", "compaction"]),
    st.dictionaries(keys, json_values, max_size=4),
)
sessions = st.lists(events, min_size=1, max_size=4)


@pytest.fixture
def small_store(database_url: str, tmp_path: Path) -> Iterator[SessionStore]:
    settings_ = Settings(
        data_dir=tmp_path / "data",
        database_url=database_url,
        image_min_base64_chars=IMAGE_MIN,
        inline_string_limit=INLINE_LIMIT,
    )
    with SessionStore.from_settings(settings_) as store:
        yield store


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(session_events=sessions)
def test_round_trip_is_byte_identical(
    small_store: SessionStore, session_events: list[dict[str, Any]]
) -> None:
    session = small_store.create_session(tenant_id="acme")
    small_store.append(session.id, session_events)
    expected = [canonical(strip_transient(e)) for e in session_events]
    exact = small_store.read(session.id, rehydrate=True)
    assert [canonical(e.payload) for e in exact] == expected
    lazy = small_store.read(session.id, rehydrate="lazy")
    assert [canonical(materialize(e.payload)) for e in lazy] == expected
    stored = small_store.read(session.id)
    assert all("\x00" not in orjson.dumps(e.payload).decode() for e in stored)


# exact and lazy reads -------------------------------------------------------------------


def image_event(raw: bytes) -> dict[str, Any]:
    data = base64.b64encode(raw).decode()
    return {
        "type": "message",
        "message": {"role": "user", "content": [{"type": "image", "data": data}]},
    }


def big_event(text: str) -> dict[str, Any]:
    return {"type": "message", "message": {"role": "assistant", "content": [text]}}


class CountingGets:
    def __init__(self, store: SessionStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        real_get = store.blobs.get

        def get(blob_hash: str) -> bytes:
            self.calls.append(blob_hash)
            return real_get(blob_hash)

        monkeypatch.setattr(store.blobs, "get", get)


@pytest.fixture
def filled(store: SessionStore) -> tuple[str, list[dict[str, Any]]]:
    session = store.create_session(tenant_id="acme")
    evs = [big_event("a" * 20_000), image_event(PNG + bytes(3000)), big_event("b" * 20_000)]
    store.append(session.id, evs)
    return session.id, evs


def test_exact_rehydration_with_windows(
    store: SessionStore, filled: tuple[str, list[dict[str, Any]]]
) -> None:
    session_id, evs = filled
    assert [e.payload for e in store.read(session_id, rehydrate=True)] == evs
    window = store.read(session_id, after_seq=1, limit=1, rehydrate=True)
    assert [e.payload for e in window] == evs[1:2]
    assert [e.payload for e in store.rehydrate(store.read_all())] == evs


def test_metadata_only_reads_never_touch_the_blob_store(
    store: SessionStore,
    filled: tuple[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session_id, evs = filled
    gets = CountingGets(store, monkeypatch)
    manifests: list[int] = []
    real_manifest = store.journal.manifest_of
    monkeypatch.setattr(
        store.journal, "manifest_of", lambda p: manifests.append(1) or real_manifest(p)
    )
    plain = store.read(session_id)
    assert manifests == [] and gets.calls == []
    assert plain[0].payload["message"]["content"][0] == make_ref(sha256_hex(b"a" * 20_000))

    lazy = store.read(session_id, rehydrate="lazy")
    assert gets.calls == []
    value = lazy[0].payload["message"]["content"][0]
    assert isinstance(value, LazyBlob)
    assert (value.hash, value.size, value.encoding) == (sha256_hex(b"a" * 20_000), 20_000, "utf8")
    assert value.pointer == "/message/content/0"
    # Lazy reads compare by content address, without loading anything.
    again = store.read(session_id, rehydrate="lazy")
    assert [e.payload for e in again] == [e.payload for e in lazy]
    assert (
        again[0].payload["message"]["content"][0] == value
        and len({value, again[0].payload["message"]["content"][0]}) == 1
    )
    assert value != value.ref  # never equal to a plain string (that would need a load)
    assert gets.calls == []
    assert value.load() == "a" * 20_000
    assert value.load() == "a" * 20_000  # loaded once
    assert gets.calls == [value.hash]
    assert materialize(lazy[1].payload) == evs[1]


def test_rehydration_does_not_modify_the_stored_event(
    store: SessionStore, filled: tuple[str, list[dict[str, Any]]]
) -> None:
    session_id, _ = filled
    plain = store.read(session_id)
    before = orjson.dumps([e.payload for e in plain])
    store.rehydrate(plain)
    store.rehydrate(plain, lazy=True)
    assert orjson.dumps([e.payload for e in plain]) == before


def test_a_blob_read_once_per_call_for_repeated_refs(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = store.create_session(tenant_id="acme")
    store.append(session.id, [big_event("r" * 20_000)] * 5)
    gets = CountingGets(store, monkeypatch)
    assert len(store.read(session.id, rehydrate=True)) == 5
    assert len(gets.calls) == 1


# missing and damaged blobs --------------------------------------------------------------


def warnings_about(caplog: pytest.LogCaptureFixture, blob_hash: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "blob_hash", None) == blob_hash]


def test_missing_blob_keeps_the_ref_warns_and_the_read_continues(
    store: SessionStore,
    filled: tuple[str, list[dict[str, Any]]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    session_id, evs = filled
    gone = sha256_hex(b"a" * 20_000)
    store.blobs.remove_file(gone)
    with caplog.at_level(logging.WARNING, logger="core.blobs.rehydrate"):
        events = store.read(session_id, rehydrate=True)
    assert events[0].payload["message"]["content"][0] == make_ref(gone)
    assert [e.payload for e in events[1:]] == evs[1:]
    [record] = warnings_about(caplog, gone)
    assert record.levelno == logging.WARNING
    assert (record.session_id, record.seq, record.pointer) == (session_id, 1, "/message/content/0")  # type: ignore[attr-defined]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="core.blobs.rehydrate"):
        lazy = store.read(session_id, rehydrate="lazy")
        assert lazy[0].payload["message"]["content"][0].load() == make_ref(gone)
    assert len(warnings_about(caplog, gone)) == 1


def test_corrupted_blob_is_never_returned(
    store: SessionStore,
    filled: tuple[str, list[dict[str, Any]]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    session_id, _ = filled
    damaged, path = _image_blob(store)
    _flip_middle_byte(path)
    with caplog.at_level(logging.WARNING, logger="core.blobs.rehydrate"):
        events = store.read(session_id, rehydrate=True)
    assert events[1].payload["message"]["content"][0]["data"] == make_ref(damaged)
    assert events[0].payload["message"]["content"][0] == "a" * 20_000
    assert warnings_about(caplog, damaged)[0].levelno == logging.ERROR


def test_only_the_path_to_a_ref_is_copied(
    store: SessionStore, filled: tuple[str, list[dict[str, Any]]]
) -> None:
    session = store.create_session(tenant_id="acme")
    event = image_event(PNG + bytes(3000))
    event["meta"] = {"kept": ["as", "stored"]}
    store.append(session.id, [event])
    [plain] = store.read(session.id)
    [restored] = store.rehydrate([plain])
    assert restored.payload == event
    assert restored.payload["meta"] is plain.payload["meta"]  # shared, not copied
    assert plain.payload["message"]["content"][0]["data"].startswith("blob:sha256:")


def _image_blob(store: SessionStore) -> tuple[str, Path]:
    """Hash and file of the image of ``filled`` (PNG: stored as is, never gzipped)."""
    image_hash = sha256_hex(PNG + bytes(3000))
    assert isinstance(store.blobs, FileBlobStore)
    return image_hash, store.blobs.path_for(image_hash, "identity")


def _flip_middle_byte(path: Path) -> bytes:
    original = path.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0x01
    path.write_bytes(bytes(damaged))
    return original


def test_a_verified_value_is_read_once_per_store_and_a_corrupt_one_never_cached(
    store: SessionStore,
    filled: tuple[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session_id, evs = filled
    image_hash, path = _image_blob(store)
    original = _flip_middle_byte(path)  # corrupt before the first read: never cached
    first = store.read(session_id, rehydrate=True)
    assert first[1].payload["message"]["content"][0]["data"] == make_ref(image_hash)
    path.write_bytes(original)

    gets = CountingGets(store, monkeypatch)
    assert [e.payload for e in store.read(session_id, rehydrate=True)] == evs
    assert gets.calls == [image_hash]  # the texts were verified by the first read
    gets.calls.clear()
    _flip_middle_byte(path)  # after verification: the cache holds the verified content
    assert [e.payload for e in store.read(session_id, rehydrate=True)] == evs
    assert gets.calls == []

    # Another store (another process) has verified nothing: it finds the corruption.
    with SessionStore.from_settings(store.settings) as other:
        again = other.read(session_id, rehydrate=True)
    assert again[1].payload["message"]["content"][0]["data"] == make_ref(image_hash)


# the state's lazy values --------------------------------------------------------------


def test_a_lazy_states_text_is_the_text_and_its_dict_is_json_with_refs(
    small_store: SessionStore,
) -> None:
    """``state()`` defaults to ``rehydrate="lazy"``: ``Message.text`` reads the externalized
    text (it was empty), and ``to_dict()`` gives each lazy value as its ref, the same JSON as
    ``rehydrate=False`` (and the CLI's ``state --json``); it raised TypeError."""
    store = small_store
    big, bigger = "hello world " * 100, "tool output " * 100  # over INLINE_LIMIT: blobs
    session = store.create_session(tenant_id="acme")
    store.append(
        session.id,
        [
            {"type": "message", "id": "a", "parentId": None,
             "message": {"role": "user", "content": big}},
            {"type": "message", "id": "b", "parentId": "a", "message": {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "short"},
                    {"type": "text", "text": big},
                    {"type": "toolCall", "id": "c1", "name": "bash", "arguments": {"x": big}},
                ],
            }},
            {"type": "message", "id": "c", "parentId": "b", "message": {
                "role": "toolResult", "toolCallId": "c1", "toolName": "bash",
                "content": [{"type": "text", "text": bigger}],
            }},
            {"type": "compaction", "id": "d", "parentId": "c", "summary": bigger,
             "firstKeptEntryId": "a", "tokensBefore": 9},
            {"type": "custom", "id": "e", "parentId": "d", "customType": "x",
             "data": {"blob": big}},
        ],
    )  # fmt: skip
    lazy = store.state(session.id)
    exact = store.state(session.id, rehydrate=True)
    as_stored = store.state(session.id, rehydrate=False)

    assert isinstance(lazy.messages[1].content, LazyBlob)  # the compaction summary comes first
    assert [m.text for m in lazy.messages] == [m.text for m in exact.messages]
    assert [m.text for m in lazy.messages] == [bigger, big, f"short\n{big}", bigger]

    as_json = json.loads(json.dumps(lazy.to_dict()))
    assert as_json == json.loads(json.dumps(as_stored.to_dict()))
    assert make_ref(sha256_hex(big.encode())) in json.dumps(as_json["tool_calls"])
    assert as_json["custom"]["x"]["data"]["blob"] == make_ref(sha256_hex(big.encode()))
    assert json.loads(json.dumps(exact.to_dict()))["custom"]["x"]["data"]["blob"] == big
