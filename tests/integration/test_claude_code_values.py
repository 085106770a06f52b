"""Whatever text a transcript holds (NUL, any code point, lone surrogates, -0.0, integers
beyond 64 bits, deep nesting) comes back exactly from the journal after an import, on both
backends, and so does every line's content (blocks with keys pi has no place for, values of
odd types)."""

from __future__ import annotations

import base64
import hashlib
import io
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.blobs.externalize import TRANSIENT_FIELDS
from core.interop import pi
from core.interop.claude_code import line_content, parse_claude_code
from core.interop.importer import parse_file_data
from core.store import SessionStore
from tests.support import store_examples
from tests.unit.test_pi_format import with_lone_surrogates

# any code point, NUL and lone surrogates too (an entry holding one is kept as its text,
# ``pi.ESCAPED_LINE``, as a pi line holding one is): everything must come back exactly
_text = with_lone_surrogates(st.text(st.characters(codec="utf-8"), max_size=20))
# the journal refuses object keys with U+0000 (a typed InvalidEvent), on both backends. The
# keys it drops as pi's transient state (TRANSIENT_FIELDS, DESIGN invariant 7) are a Claude
# Code line's data like any other, kept escaped, so they come back too (Hypothesis draws
# string constants from the code under test: it drew "partialJson" as a tool input's key)
_key = _text.filter(lambda k: "\x00" not in k) | st.sampled_from(sorted(TRANSIENT_FIELDS))
_scalar = (
    st.none()
    | st.booleans()
    | st.integers(-(2**200), 2**200)
    # integral floats of 1e16 and more come back from jsonb as integers until the journal's
    # exact values land (DESIGN invariant 11, the journal helper's part of this session)
    | st.floats(-1e15, 1e15, allow_nan=False)
    | st.just(-0.0)
    | _text
)
_json = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_key, inner, max_size=3),
    max_leaves=10,
) | st.builds(  # nested deep, well inside the journal's max_event_depth
    lambda depth, leaf: _nested(depth, leaf), st.integers(20, 40), _scalar
)
_counter = itertools.count()


def _nested(depth: int, leaf: Any) -> Any:
    for n in range(depth):
        leaf = [leaf] if n % 2 else {"k": leaf}
    return leaf


@pytest.mark.slow
@store_examples(15)
@given(prompt=_text, answer=_text, tool_input=st.dictionaries(_key, _json, max_size=3))
def test_transcript_values_come_back_exactly(
    store: SessionStore, tmp_path: Path, prompt: str, answer: str, tool_input: dict[str, Any]
) -> None:
    sid = f"s-{next(_counter)}"
    base = {"sessionId": sid, "timestamp": "2026-01-01T00:00:00Z"}
    call = {"type": "tool_use", "id": "t", "name": "T", "input": tool_input}
    reply = {"id": "m", "role": "assistant", "model": "x", "usage": {}}
    lines = [
        {**base, "type": "user", "uuid": "u", "parentUuid": None,
         "message": {"role": "user", "content": prompt}},
        {**base, "type": "assistant", "uuid": "a", "parentUuid": "u",
         "message": {**reply, "content": [{"type": "text", "text": answer}, call]}},
    ]  # fmt: skip
    path = tmp_path / f"{sid}.jsonl"
    path.write_bytes(b"".join(json.dumps(x).encode() + b"\n" for x in lines))
    result = store.import_session(path, tenant_id="acme", format="claude-code")
    stored = [e.payload for e in store.read(result.session_id, rehydrate=True)][1:]
    assert stored == [p.entry for p in parse_claude_code(path, path.read_bytes()).entries]
    arguments = pi.line_value(stored[1])["message"]["content"][1]["arguments"]
    assert json.dumps(arguments) == json.dumps(tool_input)


# content blocks of each mapped kind, with any extra keys (or known keys with odd values)
_extra = st.dictionaries(
    st.sampled_from(["cache_control", "citations", "caller", "input", "content", "is_error"])
    | _key,
    _json,
    max_size=2,
)
_blocks = st.lists(
    st.one_of(
        st.builds(lambda t, x: {"type": "text", "text": t, **x}, _text, _extra),
        st.builds(
            lambda i, x: {"type": "tool_use", "id": "t", "name": "T", "input": i, **x},
            st.dictionaries(_key, _json, max_size=2) | _json,
            _extra,
        ),
        st.builds(
            lambda c, x: {"tool_use_id": "t", "type": "tool_result", "content": c, **x},
            _text
            | st.lists(st.builds(lambda t, x: {"type": "text", "text": t, **x}, _text, _extra)),
            _extra,
        ),
        _json,
    ),
    max_size=3,
)


@pytest.mark.slow
@store_examples(15)
@given(user=_blocks | _json, assistant=_blocks | _json)
def test_every_line_content_comes_back_from_the_journal(
    store: SessionStore, tmp_path: Path, user: Any, assistant: Any
) -> None:
    """Each line's ``message.content`` is rebuilt exactly (``line_content``, docs/formats.md)
    from the events read back: mapped to pi where that is exact, kept as written where not."""
    sid = f"c-{next(_counter)}"
    base = {"sessionId": sid, "timestamp": "2026-01-01T00:00:00Z"}
    lines = [
        {**base, "type": "user", "uuid": "u", "parentUuid": None,
         "message": {"role": "user", "content": user}},
        {**base, "type": "assistant", "uuid": "a", "parentUuid": "u",
         "message": {"role": "assistant", "content": assistant}},
    ]  # fmt: skip
    path = tmp_path / f"{sid}.jsonl"
    path.write_bytes(b"".join(json.dumps(x).encode() + b"\n" for x in lines))
    result = store.import_session(path, tenant_id="acme", format="claude-code")
    chains: list[list[dict[str, Any]]] = [[]]
    for event in store.read(result.session_id, after_seq=1, rehydrate=True):
        chains[-1].append(event.payload)
        if "partOf" not in pi.line_value(event.payload)["claudeCode"]:  # keeps the uuid
            chains.append([])
    got = [line_content(chain) for chain in chains[:-1]]
    assert json.dumps(got) == json.dumps([user, assistant])


def test_a_lone_surrogate_is_kept_and_exported_exactly(store: SessionStore, tmp_path: Path) -> None:
    """A transcript line holding a lone surrogate (Claude Code's JSON.stringify writes one
    for a string cut inside an emoji) is imported, as pi lines are (it was refused): each
    entry holding one is kept as its exact text (``pi.ESCAPED_LINE``), its content comes
    back exactly (``line_content``), the state shows its messages, the session row holds
    the id, cwd and title with the surrogate escaped, the header keeps the exact id and cwd
    (an escaped line too), and the export writes each entry as that text: imported again,
    it is the same session, unchanged."""
    base = {"sessionId": "lone\udc01", "timestamp": "2026-01-01T00:00:00Z", "cwd": "/w\ud800"}
    call = {"type": "tool_use", "id": "t", "name": "T", "input": {"k\udc00": [-0.0, 2**70]}}
    reply = {"id": "m", "role": "assistant", "model": "x\udfff", "usage": {}}
    lines = [
        {**base, "type": "user", "uuid": "u", "parentUuid": None,
         "message": {"role": "user", "content": "broken emoji \ud83d"}},
        {**base, "type": "assistant", "uuid": "a", "parentUuid": "u",
         "message": {**reply, "content": [{"type": "text", "text": "ok"}, call]}},
        {**base, "type": "summary", "summary": "title \ud83d", "leafUuid": "a"},
    ]  # fmt: skip
    path = tmp_path / "lone.jsonl"
    path.write_bytes(b"".join(json.dumps(x).encode() + b"\n" for x in lines))
    result = store.import_session(path, tenant_id="acme")
    assert (result.status, result.appended) == ("created", 4)
    session = store.resolve_session("lone\\udc01", tenant_id="acme")
    assert (session.title, session.cwd) == ("title \\ud83d", "/w\\ud800")
    events = store.read(result.session_id, rehydrate=True)
    assert [e.type for e in events] == [pi.ESCAPED_LINE] * 4
    assert all(not pi.holds_lone_surrogate(e.payload) for e in events)
    contents = [line_content([e.payload]) for e in events[1:3]]
    assert json.dumps(contents) == json.dumps([x["message"]["content"] for x in lines[:2]])
    state = store.state(result.session_id, rehydrate=True)
    assert [(m.role, m.text) for m in state.messages] == [
        ("user", "broken emoji \ud83d"),
        ("assistant", "ok"),
    ]
    assert state.info.model is not None and state.info.model.model_id == "x\udfff"
    out = io.StringIO()
    store.export_session(result.session_id, out)
    parsed = parse_file_data(path, path.read_bytes())
    entries = [pi.header_event(parsed.header), *(e.entry for e in parsed.entries)]
    assert out.getvalue().splitlines() == [pi.line_text(e) for e in entries]
    exported = tmp_path / "exported.jsonl"
    exported.write_text(out.getvalue(), encoding="utf-8", errors="surrogatepass")
    again = store.import_session(exported, tenant_id="acme")
    assert (again.status, again.session_id) == ("unchanged", result.session_id)
    assert store.import_session(path, tenant_id="acme").status == "unchanged"


# the names and the ref as written, and spelled with JSON escapes (the same text)
SPELLINGS = pytest.mark.parametrize("spelled", ["plain", "escaped"])
_ESCAPED_SPELLINGS = (
    (b"partialJson", b"partial\\u004ason"),
    (b"jsonlEvents", b"jsonl\\u0045vents"),
    (b"blob:sha256:", b"blob\\u003asha256:"),
)


def spell(text: bytes, spelled: str) -> bytes:
    for plain, escaped in _ESCAPED_SPELLINGS if spelled == "escaped" else ():
        text = text.replace(plain, escaped)
    return text


@SPELLINGS
def test_keys_the_journal_drops_and_image_data_reading_as_a_ref_come_back_exactly(
    store: SessionStore, tmp_path: Path, spelled: str
) -> None:
    """A tool's input and result with ``partialJson`` and ``jsonlEvents`` keys (pi's
    transient state, which the journal drops: in a Claude Code line, data like any other)
    and an image whose data reads ``blob:sha256:<hex>`` (the journal takes that for a ref:
    one naming another session's blob served that blob's image, one naming none failed
    the import after its session was created) come back exactly, and the export imports
    again unchanged; spelled with JSON escapes too. Fails before: the keys were dropped at
    every depth, silently (and, before a review, when spelled with escapes)."""
    image = base64.b64encode(bytes(range(256)) * 8).decode()
    other = store.create_session(tenant_id="acme")
    store.append(other.id, [{"type": "custom", "content": [{"type": "image", "data": image}]}])
    stored_ref = "blob:sha256:" + hashlib.sha256(base64.b64decode(image)).hexdigest()
    absent = "blob:sha256:" + "0" * 64
    base = {"sessionId": "refs", "timestamp": "2026-01-01T00:00:00Z", "cwd": "/w"}
    call = {
        "type": "tool_use",
        "id": "t",
        "name": "query",
        "input": {"partialJson": '{"q": 1}', "jsonlEvents": ["e1"], "sql": "select 1"},
    }
    images = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": d}}
        for d in (stored_ref, absent)
    ]
    result_block = {"type": "tool_result", "tool_use_id": "t", "content": "ok"}
    lines = [
        {**base, "type": "user", "uuid": "u", "parentUuid": None,
         "message": {"role": "user", "content": [{"type": "text", "text": "look"}, *images]}},
        {**base, "type": "assistant", "uuid": "a", "parentUuid": "u",
         "message": {"id": "m", "role": "assistant", "model": "x", "usage": {},
                     "content": [call]}},
        {**base, "type": "user", "uuid": "r", "parentUuid": "a",
         "toolUseResult": {"rows": [{"partialJson": "x", "id": 7}]},
         "message": {"role": "user", "content": [result_block]}},
    ]  # fmt: skip
    path = tmp_path / "refs.jsonl"
    path.write_bytes(spell(b"".join(json.dumps(x).encode() + b"\n" for x in lines), spelled))
    result = store.import_session(path, tenant_id="acme")
    assert result.status == "created"
    stored = [e.payload for e in store.read(result.session_id, rehydrate=True)][1:]
    assert stored == [p.entry for p in parse_claude_code(path, path.read_bytes()).entries]
    values = [pi.line_value(entry) for entry in stored]
    arguments = [b["arguments"] for v in values for b in _blocks_of(v) if "arguments" in b]
    assert arguments == [call["input"]]
    datas = [b["data"] for v in values for b in _blocks_of(v) if b.get("type") == "image"]
    assert datas == [stored_ref, absent]
    exported = tmp_path / "exported.jsonl"
    with exported.open("w", encoding="utf-8") as out:
        store.export_session(result.session_id, out)
    text = exported.read_text(encoding="utf-8")
    assert text.count('"partialJson"') == 2 and '"jsonlEvents":["e1"]' in text
    assert text.count(stored_ref) == 1 and text.count(absent) == 1 and image not in text
    # named: a file holding a ref is taken for oh-my-pi's, whose refs name its blob files
    again = store.import_session(exported, tenant_id="acme", format="pi")
    assert (again.status, again.session_id) == ("unchanged", result.session_id)


def _blocks_of(value: dict[str, Any]) -> list[dict[str, Any]]:
    message = value.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []
