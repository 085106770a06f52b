"""URL resolution: artifact://, agent:// (with JSON extraction), art_…, blob:sha256:…"""

from __future__ import annotations

import base64
import json

import pytest

from core import SessionStore
from core.artifacts.jsonquery import apply_query, parse_query, path_to_query
from core.blobs.store import sha256_hex
from core.errors import BlobCorrupted, ResolveError, ResolveNotFound
from tests.contract.artifact_backends import FILE_ONLY, artifact_backend, settings

__all__ = ["FILE_ONLY", "artifact_backend", "settings"]  # each test on file:// and s3://

# Backend-independent behavior: one backend is enough.
SQLITE_ONLY = pytest.mark.parametrize("backend", ["sqlite"])


@pytest.fixture
def sid(store: SessionStore) -> str:
    return store.create_session(tenant_id="acme").id


def _resolve(store: SessionStore, url: str, sid: str, **kwargs: int) -> str:
    return store.resolve(url, session_id=sid, **kwargs).content


# --- artifact://<id> --------------------------------------------------------------------------


def test_artifact_returns_exact_text(store: SessionStore, sid: str) -> None:
    text = "line 1\r\nline 2 ☃\n\ttabbed\n"
    artifact_id = store.artifacts(sid).save(text, "bash")
    resolved = store.resolve(f"artifact://{artifact_id}", session_id=sid)
    assert (resolved.content, resolved.content_type) == (text, "text/plain")
    assert resolved.size == len(text.encode()) and resolved.url == "artifact://0"
    assert _resolve(store, "artifact://0/", sid) == text


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("artifact://", "artifact:// URL requires a numeric ID: artifact://0"),
        ("artifact://abc", "artifact:// ID must be numeric, got: abc"),
        ("artifact://-1", "artifact:// ID must be numeric, got: -1"),
        ("artifact://1.5", "artifact:// ID must be numeric, got: 1.5"),
        ("artifact://٣", "artifact:// ID must be numeric, got: ٣"),  # non-ASCII digit
        ("artifact://art_0123456789abcdef", "ID must be numeric, got: art_0123456789abcdef"),
    ],
)
@SQLITE_ONLY
def test_artifact_id_errors(store: SessionStore, sid: str, url: str, message: str) -> None:
    store.artifacts(sid).save("x", "bash")
    with pytest.raises(ResolveError) as info:
        store.resolve(url, session_id=sid)
    assert not isinstance(info.value, ResolveNotFound)
    assert message in info.value.message


@SQLITE_ONLY
def test_artifact_takes_no_path_or_query(store: SessionStore, sid: str) -> None:
    store.artifacts(sid).save("x", "bash")
    for url in ("artifact://0/x", "artifact://0?q=1"):
        with pytest.raises(ResolveError, match="no path or query"):
            store.resolve(url, session_id=sid)


def test_no_artifacts_directory(store: SessionStore, sid: str) -> None:
    with pytest.raises(ResolveNotFound, match=r"^No artifacts directory found$"):
        store.resolve("artifact://0", session_id=sid)


def test_not_found_lists_available_ids_numerically(store: SessionStore, sid: str) -> None:
    manager = store.artifacts(sid)
    for _ in range(12):
        manager.save("x", "bash")
    manager.discard_tool_output("5")
    with pytest.raises(ResolveNotFound) as info:
        store.resolve("artifact://99", session_id=sid)
    assert info.value.message == (
        "Artifact 99 not found. Available: 0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11"
    )


def test_not_found_with_none_available(store: SessionStore, sid: str) -> None:
    store.artifacts(sid).save_agent_output("a", "x")  # directory exists, no tool outputs
    with pytest.raises(ResolveNotFound) as info:
        store.resolve("artifact://0", session_id=sid)
    assert info.value.message == "Artifact 0 not found. Available: none"


# --- agent://<id> -----------------------------------------------------------------------------


DOC = {"a": {"b": [10, {"c": "deep"}], "k-y": True}, "list": [], "text": "é"}


@pytest.fixture
def agent_id(store: SessionStore, sid: str) -> str:
    return store.artifacts(sid).save_agent_output("explore", json.dumps(DOC))


def test_agent_returns_markdown(store: SessionStore, sid: str) -> None:
    output_id = store.artifacts(sid).save_agent_output("writer", "# Title\n\nbody\n")
    resolved = store.resolve(f"agent://{output_id}", session_id=sid)
    assert (resolved.content, resolved.content_type) == ("# Title\n\nbody\n", "text/markdown")
    nested = store.artifacts(sid).save_agent_output("sub", "child", parent_id=output_id)
    assert _resolve(store, f"agent://{nested}", sid) == "child"


@pytest.mark.parametrize(
    ("suffix", "value"),
    [
        ("/a/b/0", 10),
        ("/a/b/1/c", "deep"),
        ("/a/k-y", True),
        ("/text", "é"),
        ("/a/b/7", None),  # missing -> null
        ("/nope/x", None),
        ("/a/b/x", None),  # a key on an array
        ("/list", []),
        ("?q=.a.b[1].c", "deep"),
        ("?q=.a[%22k-y%22]", True),
        ("?q=a.b", [10, {"c": "deep"}]),
        ("?q=.missing", None),
        ("/", DOC),  # a bare slash is no extraction: the whole (markdown) document
    ],
)
@SQLITE_ONLY
def test_agent_json_extraction(
    store: SessionStore, sid: str, agent_id: str, suffix: str, value: object
) -> None:
    resolved = store.resolve(f"agent://{agent_id}{suffix}", session_id=sid)
    if suffix == "/":
        assert resolved.content_type == "text/markdown"
        assert json.loads(resolved.content) == value
        return
    assert resolved.content_type == "application/json"
    assert resolved.content == json.dumps(value, indent=2, ensure_ascii=False)
    assert json.loads(resolved.content) == value
    assert resolved.notes and resolved.notes[0].startswith("Extracted: ")


@SQLITE_ONLY
def test_extracted_json_is_two_space_indented(store: SessionStore, sid: str, agent_id: str) -> None:
    assert (
        _resolve(store, f"agent://{agent_id}/a/b", sid) == '[\n  10,\n  {\n    "c": "deep"\n  }\n]'
    )
    assert _resolve(store, f"agent://{agent_id}/a/b/9", sid) == "null"


@SQLITE_ONLY
def test_path_is_the_equivalent_query(store: SessionStore, sid: str, agent_id: str) -> None:
    assert path_to_query("/a/b/0") == ".a.b[0]"
    by_path = _resolve(store, f"agent://{agent_id}/a/b/0", sid)
    assert by_path == _resolve(store, f"agent://{agent_id}?q=.a.b[0]", sid)


@pytest.mark.parametrize(
    ("url_suffix", "message"),
    [
        ("/a?q=.a", "agent:// URL cannot combine path extraction with ?q="),
        ("?x=1", "agent:// URL takes only ?q=, got: x"),
        ("?q=.a[", "Invalid query: missing ]"),
        ("?q=.a[]", "Invalid query: empty []"),
        ("?q=.a!", "Invalid query: unexpected '!'"),
    ],
)
@SQLITE_ONLY
def test_agent_url_errors(
    store: SessionStore, sid: str, agent_id: str, url_suffix: str, message: str
) -> None:
    with pytest.raises(ResolveError, match=message.replace("[", r"\[").replace("?", r"\?")):
        store.resolve(f"agent://{agent_id}{url_suffix}", session_id=sid)


@SQLITE_ONLY
def test_agent_empty_id(store: SessionStore, sid: str) -> None:
    with pytest.raises(ResolveError, match="agent:// URL requires an output ID: agent://<id>"):
        store.resolve("agent://", session_id=sid)


def test_agent_not_found_lists_available(store: SessionStore, sid: str, agent_id: str) -> None:
    store.artifacts(sid).save_agent_output("second", "x")
    with pytest.raises(ResolveNotFound) as info:
        store.resolve("agent://9-ghost", session_id=sid)
    assert info.value.message == "Not found: 9-ghost\nAvailable: 0-explore, 1-second"


def test_agent_not_found_with_none_available(store: SessionStore, sid: str) -> None:
    store.artifacts(sid).save("x", "bash")
    with pytest.raises(ResolveNotFound) as info:
        store.resolve("agent://0-x", session_id=sid)
    assert info.value.message == "Not found: 0-x\nAvailable: none"
    with pytest.raises(ResolveNotFound, match="No artifacts directory found"):
        store.resolve("agent://0-x", session_id=store.create_session(tenant_id="acme").id)


@SQLITE_ONLY
def test_non_json_output_cannot_be_extracted(store: SessionStore, sid: str) -> None:
    output_id = store.artifacts(sid).save_agent_output("writer", "# not json")
    with pytest.raises(ResolveError, match=f"^Output {output_id} is not valid JSON: Expecting"):
        store.resolve(f"agent://{output_id}/a", session_id=sid)
    nan = store.artifacts(sid).save_agent_output("nan", '{"a": NaN}')
    with pytest.raises(ResolveError, match=f"Output {nan} is not valid JSON: NaN"):
        store.resolve(f"agent://{nan}?q=.a", session_id=sid)


# --- pagination -------------------------------------------------------------------------------


@SQLITE_ONLY
def test_plain_reads_page_by_lines(store: SessionStore, sid: str) -> None:
    text = "".join(f"line {i}\n" for i in range(1, 11))
    store.artifacts(sid).save(text, "bash")
    page = store.resolve("artifact://0", session_id=sid, offset=3, limit=2)
    assert page.content == "line 3\nline 4\n" and page.size == 14
    assert page.notes == ["Showing lines 3-4 of 10", "More available: continue with offset=5"]
    assert _resolve(store, "artifact://0", sid, offset=10) == "line 10\n"
    assert _resolve(store, "artifact://0", sid, limit=1) == "line 1\n"
    assert _resolve(store, "artifact://0", sid, offset=9, limit=50) == "line 9\nline 10\n"
    with pytest.raises(ResolveError, match="offset 11 is beyond the end"):
        store.resolve("artifact://0", session_id=sid, offset=11)
    for bad in ({"offset": 0}, {"limit": 0}, {"offset": -1}):
        with pytest.raises(ResolveError):
            store.resolve("artifact://0", session_id=sid, **bad)


@SQLITE_ONLY
def test_last_line_without_newline_counts(store: SessionStore, sid: str) -> None:
    store.artifacts(sid).save("a\nb", "bash")
    page = store.resolve("artifact://0", session_id=sid, offset=2)
    assert page.content == "b" and page.notes == ["Showing lines 2-2 of 2"]


@SQLITE_ONLY
def test_agent_markdown_pages_but_extraction_refuses(
    store: SessionStore, sid: str, agent_id: str
) -> None:
    output_id = store.artifacts(sid).save_agent_output("w", "a\nb\nc\n")
    assert _resolve(store, f"agent://{output_id}", sid, offset=2, limit=1) == "b\n"
    for kwargs in ({"offset": 1}, {"limit": 5}):
        with pytest.raises(ResolveError, match="extraction does not take offset/limit"):
            store.resolve(f"agent://{agent_id}/a", session_id=sid, **kwargs)
        with pytest.raises(ResolveError, match="extraction does not take offset/limit"):
            store.resolve(f"agent://{agent_id}?q=.a", session_id=sid, **kwargs)


# --- other forms ------------------------------------------------------------------------------


def test_oversized_ids_resolve(store: SessionStore, sid: str) -> None:
    content = "big\n" * 4000
    stored = store.store_oversized(sid, content, "bash")
    assert stored is not None
    resolved = store.resolve(stored.ref.artifact_id, session_id=sid)
    assert (resolved.content, resolved.content_type) == (content, "text/plain")
    assert _resolve(store, stored.ref.artifact_id, sid, offset=4000) == "big\n"
    with pytest.raises(ResolveNotFound, match="not found"):
        store.resolve("art_0000000000000000", session_id=sid)
    with pytest.raises(ResolveError, match="expected art_<16 hex>"):
        store.resolve("art_XYZ", session_id=sid)


@SQLITE_ONLY
def test_unsupported_url(store: SessionStore, sid: str) -> None:
    for url in ("http://x", "file:///etc/passwd", "3", ""):
        with pytest.raises(ResolveError, match="unsupported URL"):
            store.resolve(url, session_id=sid)


def test_blob_refs_resolve_through_the_manifest(store: SessionStore, sid: str) -> None:
    text = "é" * 20_000  # over the inline limit: externalized as a UTF-8 blob
    image = bytes(range(256)) * 8
    event = {
        "type": "message",
        "text": text,
        "content": [{"type": "image", "data": base64.b64encode(image).decode()}],
    }
    result = store.append(sid, [event])
    refs = {
        e.encoding: e.hash for e in store.journal.manifest(result.positions)[result.positions[0]]
    }
    utf8 = store.resolve(f"blob:sha256:{refs['utf8']}", session_id=sid)
    assert (utf8.content, utf8.content_type) == (text, "text/plain")
    binary = store.resolve(f"blob:sha256:{refs['base64']}", session_id=sid)
    assert binary.content_type == "application/octet-stream"
    assert base64.b64decode(binary.content) == image
    # another tenant cannot read the same blob, even knowing its hash
    other = store.create_session(tenant_id="globex").id
    with pytest.raises(ResolveNotFound, match="blob not found"):
        store.resolve(f"blob:sha256:{refs['utf8']}", session_id=other)


@pytest.mark.parametrize(
    "ref",
    ["blob:sha256:" + "A" * 64, "blob:sha256:" + "0" * 63, "blob:md5:" + "0" * 32, "blob:"],
)
@SQLITE_ONLY
def test_invalid_blob_refs(store: SessionStore, sid: str, ref: str) -> None:
    with pytest.raises(ResolveError, match="expected blob:sha256:<64 lowercase hex>"):
        store.resolve(ref, session_id=sid)


def test_a_corrupt_or_lost_blob_is_said_to_be_so(store: SessionStore, sid: str) -> None:
    """A corrupt blob is there and refused (BlobCorrupted, as every direct read says it);
    it was reported as not found, as a lost one is."""
    text = "t" * 20_000
    store.append(sid, [{"type": "message", "message": {"role": "user", "content": text}}])
    blob_hash = sha256_hex(text.encode())
    found = store.blobs._find(blob_hash)
    assert found is not None
    store.blobs._write(blob_hash, found[0], b"not the blob")
    with pytest.raises(BlobCorrupted) as caught:
        store.resolve(f"blob:sha256:{blob_hash}", session_id=sid)
    assert caught.value.blob_hash == blob_hash
    store.blobs.remove_file(blob_hash)
    with pytest.raises(ResolveNotFound, match="blob not found"):
        store.resolve(f"blob:sha256:{blob_hash}", session_id=sid)


def test_unreferenced_blob_is_not_found(store: SessionStore, sid: str) -> None:
    blob_hash = store.blobs.put(b"stored but never referenced").hash
    with pytest.raises(ResolveNotFound, match="blob not found"):
        store.resolve(f"blob:sha256:{blob_hash}", session_id=sid)


# --- tenant isolation -------------------------------------------------------------------------


def test_another_tenants_ids_are_not_found(store: SessionStore) -> None:
    acme = store.create_session(tenant_id="acme").id
    globex = store.create_session(tenant_id="globex").id
    secret = store.artifacts(acme)
    secret.save("acme secret", "bash")
    agent = secret.save_agent_output("spy", '{"k": "acme secret"}')
    oversized = store.store_oversized(acme, "acme secret " * 2000, "bash")
    assert oversized is not None
    store.artifacts(globex).save("globex own", "bash")

    # Asking for acme's session as globex: not found, exactly like a session that does not exist.
    urls = ["artifact://0", f"agent://{agent}", f"agent://{agent}/k", oversized.ref.artifact_id]
    for url in urls:
        with pytest.raises(ResolveNotFound) as foreign:
            store.resolve(url, session_id=acme, tenant_id="globex")
        with pytest.raises(ResolveNotFound) as missing:
            store.resolve(url, session_id="no-such-session", tenant_id="globex")
        assert foreign.value.message == f"session not found: {acme}"
        assert missing.value.message == "session not found: no-such-session"
        assert "acme secret" not in foreign.value.message

    # From globex's own session, acme's ids are simply not there.
    assert _resolve(store, "artifact://0", globex) == "globex own"
    with pytest.raises(ResolveNotFound):
        store.resolve(f"agent://{agent}", session_id=globex, tenant_id="globex")
    with pytest.raises(ResolveNotFound):
        store.resolve(oversized.ref.artifact_id, session_id=globex, tenant_id="globex")
    assert store.retrieve(oversized.ref.artifact_id, session_id=globex) is None
    assert _resolve(store, "artifact://0", acme) == "acme secret"  # the owner still can


# --- the query language -----------------------------------------------------------------------


def test_query_parser() -> None:
    assert parse_query(".foo.bar[0]") == ["foo", "bar", 0]
    assert parse_query("foo['a b'][\"c]d\"]") == ["foo", "a b", "c]d"]
    assert parse_query(" .x[ 'q\\'s' ] ") == ["x", "q's"]
    assert parse_query("") == [] and parse_query(".") == []
    assert path_to_query("/a%20b/c]d/it's") == "['a b']['c]d']['it\\'s']"
    doc = {"a b": {"c]d": {"it's": 1}}}
    assert apply_query(doc, path_to_query("/a%20b/c]d/it's")) == 1
    with pytest.raises(ResolveError, match="unterminated"):
        parse_query("['open")
