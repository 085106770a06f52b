"""The pi reader and writer: pi's migrations, the truncated tail, and exact values for every
input class JSON allows (Hypothesis)."""

from __future__ import annotations

import io
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.blobs.externalize import TRANSIENT_FIELDS
from core.blobs.store import BLOB_REF_PREFIX
from core.errors import ImportFormatError
from core.interop import pi
from core.interop.importer import detect_format
from core.query.fold_codec import decode_fold, encode_fold
from core.query.projection import fold_events
from core.query.state import build_state, plan_context
from tests.contract.test_projection import SESSION, stored
from tests.fixtures.pi.generate import v1_lines, v2_lines

JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()  # lone surrogates and NUL included
)
JSON = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=30,
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return type(a) is type(b) and a == b


def _file(lines: list[dict[str, Any]]) -> bytes:
    out = io.StringIO()
    pi.write(out, lines[0], lines[1:])
    return out.getvalue().encode("utf-8")  # valid UTF-8, lone surrogates escaped


@settings(max_examples=200, deadline=None)
@given(data=JSON)
def test_write_then_parse_is_exact(data: Any) -> None:
    header = pi.new_header("h", timestamp="2026-01-01T00:00:00.000Z", cwd="/")
    entry = {"type": "custom", "id": "c1", "parentId": None, "customType": "x", "data": data}
    parsed = pi.parse(Path("x.jsonl"), _file([header, entry]))
    assert _same(parsed.entries[0].entry, entry)
    assert _same(parsed.header.raw, header)


def with_lone_surrogates(text: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """``text``, and ``text`` with a lone surrogate inside (JSON.stringify writes one for a
    string cut inside an emoji). ``st.text()`` draws none, and neither does
    ``st.text(st.characters(categories=["Cs"]) | ...)``: it merges the alphabets, and its
    default one excludes surrogates (500 examples drew none)."""
    lone = st.characters(categories=["Cs"])
    return text | st.builds(lambda before, cut, after: before + cut + after, text, lone, text)


SURROGATE_TEXT = with_lone_surrogates(st.text(max_size=3))


@settings(max_examples=200, deadline=None)
@given(key=SURROGATE_TEXT, text=SURROGATE_TEXT, data=JSON)
def test_a_line_holding_a_lone_surrogate_is_kept_exactly(key: str, text: str, data: Any) -> None:
    """pi reads such a line; no database text holds a lone surrogate. The line is kept
    escaped (``ESCAPED_LINE``, with its id and parentId): each string holding one as its
    pieces, an object with a key holding one as its members; it is written back byte for
    byte; any other line is kept as it is."""
    header = pi.new_header("h", timestamp="2026-01-01T00:00:00.000Z", cwd="/")
    entry = {"type": "custom", "id": "c1", "parentId": "p", f"k{key}": text, "data": data}
    raw = _file([header, entry])
    line = raw.splitlines()[1]
    value = pi.loads_exact(line)
    [kept] = pi.parse(Path("x.jsonl"), raw).entries
    if pi.holds_lone_surrogate(value):
        assert list(kept.entry) == ["type", "id", "parentId", "value"]
        assert (kept.entry["type"], kept.entry["id"], kept.entry["parentId"]) == (
            pi.ESCAPED_LINE,
            "c1",
            "p",
        )
        assert _same(pi.line_value(kept.entry), value)
        assert not pi.holds_lone_surrogate(kept.entry)
    else:
        assert _same(kept.entry, value)
    out = io.StringIO()
    pi.write(out, header, [kept.entry])
    assert out.getvalue().encode().splitlines()[1] == line


def test_the_escape_of_a_line_holding_a_lone_surrogate() -> None:
    """The form an escaped line is kept in (``pi.ESCAPED_LINE``'s ``value``): a string
    holding a lone surrogate as its pieces; an object with a key holding one (or U+0000, or
    one the externalizer drops, or a name of the escape) as its keys and values in order;
    everything else as it is. Undone exactly; a line the escape would nest past the
    journal's depth is kept as its text."""
    cut, s, o = "\ud83d", pi.ESCAPED_STRING, pi.ESCAPED_OBJECT
    line = {
        "type": "message",
        "id": "a",
        "text": f"x{cut}y\udc00",
        "plain": {"n": [-0.0, 2**70, "\x00"]},
        "keys": {f"k{cut}": cut, "b": 1},
        "nul": {"k\x00": 1},
        "like": {s: [1]},
        "also": {"x": 1, o: []},
        "partialJson": {"partialJson": "{"},
    }
    kept = pi.escaped_line(line)
    assert kept == {
        "type": pi.ESCAPED_LINE,
        "id": "a",
        "value": {
            o: [
                "type", "message", "id", "a",
                "text", {s: ["x", 0xD83D, "y", 0xDC00]},
                "plain", {"n": [-0.0, 2**70, "\x00"]},
                "keys", {o: [{s: ["k", 0xD83D]}, {s: [0xD83D]}, "b", 1]},
                "nul", {o: ["k\x00", 1]},
                "like", {o: [s, [1]]},
                "also", {o: ["x", 1, o, []]},
                "partialJson", {o: ["partialJson", "{"]},
            ]
        },
    }  # fmt: skip
    assert _same(pi.line_value(kept), line)
    assert pi.line_text(kept) == pi.dumps_exact(line)
    deep: Any = cut
    for _ in range(pi.ESCAPED_MAX_DEPTH):
        deep = [deep]
    deep_line = {"type": "x", "id": "d", "v": deep}
    assert pi.escaped_line(deep_line) == {
        "type": pi.ESCAPED_LINE,
        "id": "d",
        "json": pi.dumps_exact(deep_line),
    }
    # an escape not written by the import is read as the object it is
    odd = {"type": pi.ESCAPED_LINE, "value": {"a": {s: [1]}, "b": {o: ["k"]}, "c": {s: 7}}}
    assert pi.line_value(odd) == odd["value"]


@settings(max_examples=200, deadline=None)
@given(
    text=SURROGATE_TEXT,
    model=SURROGATE_TEXT,
    cwd=SURROGATE_TEXT,
    data=JSON,
    depth=st.integers(min_value=0, max_value=300),
)
def test_a_line_holding_a_lone_surrogate_is_read_by_the_state_exactly(
    text: str, model: str, cwd: str, data: Any, depth: int
) -> None:
    """pi's context holds a message whatever its line holds: the fold and the state read a
    line kept as its text (a header too) as the line itself, lone surrogates and all; the
    fold's snapshot keeps them; the file is written back byte for byte."""
    for _ in range(depth):
        data = [data]
    header = pi.new_header("h", timestamp="2026-01-01T00:00:00.000Z", cwd=cwd)
    message = {
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "provider": "p",
        "model": model,
        "details": data,
    }
    entry = {"type": "message", "id": "m1", "parentId": None, "timestamp": "t", "message": message}
    raw = _file([header, entry])
    parsed = pi.parse(Path("x.jsonl"), raw)
    events = stored([pi.header_event(parsed.header), *(e.entry for e in parsed.entries)])
    fold = decode_fold(encode_fold(fold_events(events)))  # as a snapshot keeps it
    assert fold == fold_events(events)
    state = build_state(fold, plan_context(fold), {e.seq: e for e in events}, session=SESSION)
    [read] = state.messages
    assert _same(read.data, message) and read.text == text
    assert state.info.model is not None and state.info.model.model_id == model
    assert state.info.cwd == (cwd or SESSION.cwd)  # an empty cwd is none: the row's
    out = io.StringIO()
    pi.write(out, pi.line_value(events[0].payload), [e.payload for e in events[1:]])
    assert out.getvalue().encode() == raw


def test_numbers_at_the_edges_of_64_bits_are_read_exactly() -> None:
    """orjson turns an integer beyond 64 bits into a float without a word: each of these must
    come back as the standard library reads it, wherever it sits in the line."""
    edges: list[int | float] = [2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]
    edges += [10**30, -(10**30), 9.2e18, 9.3e18, -9.3e18, 1e19, 1.5, -0.0, 0]
    for number in edges:
        for value in (number, [number], {"a": [{"b": number}], "c": "x"}):
            line = json.dumps(value)
            assert _same(pi.loads_exact(line), json.loads(line)), line
            assert _same(pi.loads_exact(line.encode()), json.loads(line)), line


def test_a_large_float_deep_inside_is_read_without_the_standard_library() -> None:
    """1e300 at depth 1,000 is a plain float: orjson's value stands (it was read again by
    the standard library, whose reader recursed past its limit: RecursionError, and the
    import crashed). A wide integer that deep cannot be read exactly: ``NestedTooDeeply``,
    which the reader refuses by the line's number, never a crash."""
    for depth in (1000, 1020):
        line = "[" * depth + "1e300" + "]" * depth
        value = pi.loads_exact(line)
        for _ in range(depth):
            [value] = value
        assert value == 1e300
    with pytest.raises(pi.NestedTooDeeply):
        pi.loads_exact("[" * 1000 + str(10**30) + "]" * 1000)


@given(deep=st.integers(min_value=1, max_value=200))
def test_deep_nesting(deep: int) -> None:
    value: Any = "leaf"
    for _ in range(deep):
        value = [value]
    header = pi.new_header("h", timestamp=None, cwd=None)
    entry = {"type": "custom", "id": "c1", "parentId": None, "data": value}
    assert pi.parse(Path("x"), _file([header, entry])).entries[0].entry == entry


def test_v1_migration_is_pis() -> None:
    lines = v1_lines()
    parsed = pi.parse(Path("v1.jsonl"), _file(lines))
    assert parsed.header.version == 1 and parsed.header.raw["version"] == 3
    assert list(parsed.header.raw) == ["type", "id", "timestamp", "cwd", "version"]
    entries = [e.entry for e in parsed.entries]
    assert entries[0]["parentId"] is None
    for before, after in itertools.pairwise(entries):
        assert after["parentId"] == before["id"]
    assert len({e["id"] for e in entries}) == len(entries)
    compaction = next(e for e in entries if e["type"] == "compaction")
    assert "firstKeptEntryIndex" not in compaction
    assert compaction["firstKeptEntryId"] == entries[7 - 1]["id"]  # index 7, header is 0
    assert list(compaction)[-3:] == ["id", "parentId", "firstKeptEntryId"]  # JS key order
    # deterministic: the same file gives the same ids
    assert [e.entry for e in pi.parse(Path("v1.jsonl"), _file(v1_lines())).entries] == entries


def test_v2_hook_message_becomes_custom() -> None:
    parsed = pi.parse(Path("v2.jsonl"), _file(v2_lines()))
    roles = [e.entry["message"]["role"] for e in parsed.entries if e.entry["type"] == "message"]
    assert "hookMessage" not in roles and "custom" in roles
    assert parsed.header.raw["version"] == 3


def test_truncated_tail_and_malformed_lines() -> None:
    header = json.dumps({"type": "session", "version": 3, "id": "h"})
    data = f'{header}\n\nnot json\n{{"type":"label","id":"l","parentId":null}}\n{{"type":"mes'
    parsed = pi.parse(Path("x"), data.encode())
    assert [e.line for e in parsed.entries] == [4]
    assert [(s.line, s.reason) for s in parsed.ignored_lines] == [(3, pi.NOT_JSON)]
    assert parsed.incomplete_tail and parsed.consumed_bytes == data.rindex("\n") + 1


def test_js_time() -> None:
    assert pi.js_time("2026-11-20T10:00:00.123Z") == 1795168800123
    assert pi.js_time("garbage") is None


def test_a_line_too_deep_to_read_is_refused_by_its_line() -> None:
    """2,000 levels is JSON pi keeps, past what the exact reader follows: refused with a
    typed error naming the line (as 100 levels is, by the journal's depth check), never
    skipped as a line that is not JSON (the next entry's parent then pointed nowhere)."""
    header = json.dumps({"type": "session", "version": 3, "id": "h"})
    deep = '{"type":"custom","id":"b","parentId":null,"data":' + "[" * 2000 + "]" * 2000 + "}"
    data = f"{header}\n\n{deep}\n".encode()
    with pytest.raises(ImportFormatError, match=r"x\.jsonl line 3: nested too deeply"):
        pi.parse(Path("x.jsonl"), data)


def test_lines_holding_no_entry_are_reported_by_line() -> None:
    """pi skips malformed lines, and its tree has no place for a value that is not an
    object. Neither kind is imported, and each is reported with its line and why (none
    silently). An object without a string type is an entry, kept wrapped (pi keeps it)."""
    header = json.dumps({"type": "session", "version": 3, "id": "h"})
    entry = '{"type":"label","id":"l","parentId":null}'
    odd = ['{"type":"message",BROKEN', "[1,2,3]", '"str"', "42", "null"]
    odd += ['{"no":"type"}', '{"type":5}']
    data = "\n".join([header, entry, *odd, "", entry.replace('"l"', '"m"')]) + "\n"
    parsed = pi.parse(Path("x"), data.encode())
    assert [e.line for e in parsed.entries] == [2, 8, 9, 11]
    assert [e.entry for e in parsed.entries[1:3]] == [
        {"type": pi.UNTYPED_LINE, "line": {"no": "type"}},
        {"type": pi.UNTYPED_LINE, "line": {"type": 5}},
    ]
    assert [(s.line, s.reason) for s in parsed.ignored_lines] == [
        (3, pi.NOT_JSON),
        *((n, pi.NOT_AN_OBJECT) for n in range(4, 8)),
    ]


def test_a_file_starting_with_blank_lines_is_detected() -> None:
    """pi skips blank lines, a leading one too (its header is the first line parsed)."""
    header = json.dumps({"type": "session", "version": 3, "id": "h"}).encode()
    for data in (b"\n" + header + b"\n", b"\n \r\n\t\n" + header + b"\n", b"\n" + header):
        assert pi.sniff(data)
        assert detect_format(Path("x.jsonl"), data) == "pi"
    assert not pi.sniff(b"\n\n") and not pi.sniff(b"\nnot json\n" + header + b"\n")


def test_a_whole_last_entry_without_its_newline_is_read() -> None:
    """pi reads a last line without a newline (``trim().split("\\n")``): so does the import,
    when it is a whole JSON object. Anything else at the end waits for the next pass."""
    header = json.dumps({"type": "session", "version": 3, "id": "h"})
    label = '{"type":"label","id":"l","parentId":null}'
    for tail, read in [
        (label, True),
        (label + " \r", True),
        (label[:-1], False),
        ('{"type":"label","id":"l","parentId":{}', False),  # ends in } but is not whole
        ("[1, 2]", False),
        ("123", False),
        ("}", False),
    ]:
        data = f"{header}\n{tail}".encode()
        parsed = pi.parse(Path("x"), data)
        assert ([e.line for e in parsed.entries] == [2]) is read, tail
        assert parsed.incomplete_tail is not read, tail
        assert parsed.consumed_bytes == (len(data) if read else len(header) + 1), tail


json_objects = st.dictionaries(
    st.text(max_size=5),
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
        max_leaves=10,
    ),
    max_size=4,
)


@settings(max_examples=200)
@given(json_objects, st.data())
def test_no_part_of_a_line_being_written_is_read_as_whole(value: Any, data: Any) -> None:
    """A writer caught part way through a line (any cut of its UTF-8 bytes) leaves a tail
    that is never taken for a whole entry; the whole line is."""
    line = pi.dumps_exact(value).encode()
    cut = data.draw(st.integers(1, len(line) - 1))
    lines, consumed, waits = pi.split_lines(b"{}\n" + line[:cut])
    assert (len(lines), consumed, waits) == (1, 3, True)
    lines, consumed, waits = pi.split_lines(b"{}\n" + line)
    assert (lines[-1], consumed, waits) == ((2, line), 3 + len(line), False)


def _spelled(text: str, escaped: list[bool], upper: list[bool]) -> bytes:
    """``text`` as JSON string bytes, each character written as itself or as a \\u escape
    (hex digits in either case)."""
    out = []
    for char, esc, up in zip(text, escaped, upper, strict=True):
        code = f"\\u{ord(char):04x}"
        out.append((code.upper().replace("\\U", "\\u") if up else code) if esc else char)
    return "".join(out).encode()


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted({*TRANSIENT_FIELDS, BLOB_REF_PREFIX + "0" * 64})),
    data=st.data(),
)
def test_the_byte_gates_fire_on_every_spelling_of_the_names(name: str, data: Any) -> None:
    """The bytes decide whether a line is walked for a key the journal drops, or an image
    whose data reads as a ref; any spelling JSON allows (a character as itself or as an
    escape, hex in either case) must open the gate, or the line is misread."""
    flags = st.lists(st.booleans(), min_size=len(name), max_size=len(name))
    spelled = _spelled(name, data.draw(flags), data.draw(flags))
    raw = b'{"type":"message","x":"' + spelled + b'"}'
    assert json.loads(raw)["x"] == name
    gate = pi.may_hold_ref if name.startswith(BLOB_REF_PREFIX) else pi.may_hold_transient_key
    assert gate(raw)


def test_the_byte_gates_stay_shut_on_the_common_escapes() -> None:
    """Terminal colours, control characters and line separators (escaped in most tool
    output) spell no name: such a line is not walked."""
    raw = b'{"type":"message","text":"\\u001b[31mred\\u001b[0m \\u0000 \\u2028"}'
    assert not pi.may_hold_ref(raw)
    assert not pi.may_hold_transient_key(raw)
    assert pi.escape_test([raw], refs=True, transient_keys=True) is None


_VALUE = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=12),
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=12,
)
_LINE = st.dictionaries(st.text(max_size=8), _VALUE, min_size=1)


@settings(max_examples=200, deadline=None)
@given(_LINE, st.data())
def test_a_file_not_started_is_told_from_one_of_no_format(
    entry: dict[str, Any], data: st.DataObject
) -> None:
    """``check_started``: no line yet (empty, blank, a BOM; or any strict prefix of a first
    line that is an object) is ``SessionFileNotStarted``; a whole object, with or without
    its line break, any text holding a line break, and text that no more text makes an
    object (more after a whole one, a control byte) are left to the format (whose error
    says what is wrong)."""
    from core.errors import SessionFileNotStarted
    from core.interop.importer import check_started

    lead = data.draw(st.sampled_from([b"", b"\xef\xbb\xbf", b" \t", b"\r"]))
    line = json.dumps(entry, ensure_ascii=data.draw(st.booleans())).encode()
    cut = data.draw(st.integers(0, len(line) - 1))
    with pytest.raises(SessionFileNotStarted) as raised:
        check_started(Path("f.jsonl"), lead + line[:cut])
    assert raised.value.empty == (cut == 0)
    assert isinstance(raised.value, ImportFormatError)  # for a caller that handles those
    ended = lead + line[: max(cut, 1)] + b"\n"  # a line, if a malformed one
    after = data.draw(st.sampled_from([b"}", b"x", b"{", b"\r{", b" 1", b"]"]))
    control = line[:cut] + data.draw(st.sampled_from([b"\0", b"\x01", b"\x1f"]))
    for whole in (lead + line, lead + line + b"\n", ended, b"\0" * 9, line + after, control):
        check_started(Path("f.jsonl"), whole)
    with pytest.raises(SessionFileNotStarted):  # JavaScript's whitespace, as pi trims it
        check_started(Path("f.jsonl"), lead + "\u00a0\n\u3000".encode() + line[:cut])


@pytest.mark.parametrize(
    "text",
    [
        b'{"a":NaN',  # JSON has no NaN, nor Infinity (pi's JSON.parse refuses them)
        b'{"a":-Infinity',
        b'{"a":true5',
        b'{"a":false+',
        b'{"a":-.',
        b'{"a":.5',
        b'{"a":E5',
        b'{"a":1.e',
        b'{"a":01',
        b'{"a":1.5.',
        b'{"a":"x\t',  # a tab in a string (untrimmed at the end: it is in the string)
        b'{"a":' + b"[" * 5000 + b"x",  # deep, then no value
        b'{"\\ux',
        b'{"a":[}',
        b'{"a":1,}',
        b'{"a":1}\xe2\x80\xa8',  # whole, then U+2028 (a line, as pi reads it)
        b'{"type":"session"}\0\0',
        b'{"a":1} {"b":2}',
    ],
)
def test_text_no_more_text_makes_an_object_is_a_line(text: bytes) -> None:
    """A review's cases: each was taken for a first line still being written (the import
    skipped the file, exit 0) though no more text makes it an object: it is a line, for
    the format to fail."""
    assert pi.not_started(text) is None


@pytest.mark.parametrize(
    "text",
    [
        b'{"a":' + b"1" * 5000,  # past int()'s digits limit: no value is built
        b'{"a":' + b"[" * 100_000,  # past any recursion limit
        b'{"a":' + b"[" * 5000 + b'{"b":1}',
        b'{"a":-0.0e-',
        b'{"a":"\\ud83d\\u',
        b'{"a":"\xff\xfe',  # invalid UTF-8 in a string: pi reads it as U+FFFD
        b'{"a": null ,"b"',
    ],
)
def test_the_start_of_an_object_is_unfinished(text: bytes) -> None:
    assert pi.not_started(text) is False
