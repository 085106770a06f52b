"""The Claude Code converter on its own: tree, content blocks, usage once per response,
compactions, sidechains, titles, and reading a file the agent is still writing."""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from core.errors import ImportFormatError
from core.interop.claude_code import line_content, looks_like_claude_code, parse_claude_code
from core.interop.importer import detect_format, parse_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "claude_code"
SESSION = FIXTURES / "7d3c5e2a-91f4-4b6e-8a0d-2c1f9e8b7a60.jsonl"


def cc_line(kind: str, uuid: str, parent: str | None, **message: Any) -> dict[str, Any]:
    return {
        "type": kind,
        "uuid": uuid,
        "parentUuid": parent,
        "sessionId": "s",
        "timestamp": "2026-01-01T00:00:00Z",
        "message": message,
    }


def by_id(path: Path = SESSION) -> dict[str, dict[str, Any]]:
    return {p.entry["id"]: p.entry for p in parse_claude_code(path, path.read_bytes()).entries}


def test_detection() -> None:
    assert looks_like_claude_code(SESSION, SESSION.read_bytes()[:4096])
    pi = b'{"type":"session","version":3,"id":"x","timestamp":"t","cwd":"/"}\n'
    assert not looks_like_claude_code(SESSION, pi)
    assert not looks_like_claude_code(SESSION, b"not json\n")
    assert not looks_like_claude_code(SESSION, b"")
    assert detect_format(SESSION, SESSION.read_bytes()[:65536]) == "claude-code"


def test_detection_of_a_first_line_beyond_64_kib(tmp_path: Path) -> None:
    """A first prompt with a pasted screenshot: the first line alone is over 64 KiB."""
    image = {"type": "image", "source": {"type": "base64", "data": "QUJD" * 25_000}}
    text = {"type": "text", "text": "what is wrong here?"}
    first = cc_line("user", "u1", None, role="user", content=[text, image])
    second = cc_line("assistant", "u2", "u1", role="assistant", content=[])
    path = tmp_path / "big.jsonl"
    path.write_text(f"{json.dumps(first)}\n{json.dumps(second)}\n")
    assert path.stat().st_size > 100_000
    parsed = parse_file(path)  # format "auto"
    assert (parsed.format, len(parsed.entries)) == ("claude-code", 2)


def test_header_title_and_external_id() -> None:
    parsed = parse_claude_code(SESSION, SESSION.read_bytes())
    assert parsed.format == "claude-code"
    assert parsed.header.external_id == "7d3c5e2a-91f4-4b6e-8a0d-2c1f9e8b7a60"
    assert parsed.header.title == "Fix the leap-year bug in parse_date"
    assert parsed.header.cwd == "/home/dev/dateparse"
    assert parsed.header.timestamp == "2026-01-20T09:00:00.000Z"
    assert parsed.consumed_bytes == SESSION.stat().st_size
    assert not parsed.incomplete_tail


def test_a_subagent_file_gets_its_own_external_id(tmp_path: Path) -> None:
    lines = [json.loads(x) for x in SESSION.read_text().splitlines()[8:12]]
    agent = tmp_path / "agent-4a1f.jsonl"
    agent.write_text("".join(json.dumps(x) + "\n" for x in lines))
    parsed = parse_claude_code(agent, agent.read_bytes())
    assert parsed.header.external_id == "7d3c5e2a-91f4-4b6e-8a0d-2c1f9e8b7a60/agent-4a1f"


def test_uuid_tree_and_every_line_kept() -> None:
    parsed = parse_claude_code(SESSION, SESSION.read_bytes())
    entries = [p.entry for p in parsed.entries]
    ids = [e["id"] for e in entries]
    assert len(ids) == len(set(ids))
    seen: set[str] = set()
    for entry in entries:  # a parent always comes before its child
        assert entry["parentId"] is None or entry["parentId"] in seen
        seen.add(entry["id"])
    tree = by_id()
    assert tree["a2-0000"]["parentId"] == "a1-0000"
    assert tree["u3-0000"]["parentId"] == "a4-0000"  # back over the sidechain
    assert tree["y1-0000"]["customType"] == "claude-code.system"
    assert tree["cc-line-1"]["customType"] == "claude-code.summary"
    # 21 lines: the boundary and its summary become one compaction
    assert [p.line for p in parsed.entries] == [*range(1, 16), *range(17, 22)]


def test_content_blocks_become_pi_shapes() -> None:
    tree = by_id()
    user = tree["u1-0000"]["message"]
    assert user["role"] == "user"
    assert user["content"][0] == {
        "type": "text",
        "text": "parse_date fails on 2024-02-29, see the screenshot",
    }
    image = user["content"][1]
    assert image["type"] == "image" and image["mimeType"] == "image/png"
    assert len(image["data"]) > 1024
    thinking = tree["a1-0000"]["message"]["content"][0]
    assert thinking["type"] == "thinking" and thinking["thinkingSignature"] == "sig-abc"
    call = tree["a3-0000"]["message"]["content"][0]
    assert call == {
        "type": "toolCall",
        "id": "toolu_01R",
        "name": "Read",
        "arguments": {"file_path": "/home/dev/dateparse/dateparse/core.py"},
    }
    assert tree["a3-0000"]["message"]["stopReason"] == "toolUse"
    result = tree["u2-0000"]["message"]
    assert result["role"] == "toolResult"
    assert result["toolCallId"] == "toolu_01R" and result["toolName"] == "Read"
    assert result["isError"] is False
    assert result["details"]["file"]["numLines"] == 2  # Claude's toolUseResult
    assert "toolUseResult" not in tree["u2-0000"]["claudeCode"]
    failed = tree["u5-0000"]["message"]
    assert failed["isError"] is True and failed["toolName"] == "Write"
    assert failed["content"] == [{"type": "text", "text": "Permission denied"}]
    final = tree["a7-0000"]["message"]
    assert final["model"] == "claude-opus-4-5-20251101" and final["stopReason"] == "stop"
    assert final["provider"] == "anthropic" and final["api"] == "anthropic-messages"
    assert final["timestamp"] == 1768989669000


def test_usage_counted_once_per_response() -> None:
    totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    responses: dict[str, int] = defaultdict(int)
    for entry in by_id().values():
        message = entry.get("message", {})
        if message.get("role") != "assistant":
            continue
        model = message["model"]
        for key in ("input", "output", "cacheRead", "cacheWrite", "totalTokens"):
            totals[model][key] += message["usage"][key]
        responses[model] += entry["claudeCode"].get("responseLine", 0) == 0
    sonnet = totals["claude-sonnet-4-5-20250929"]
    # msg_01A spans three lines whose output grows 3 -> 12 -> 40: counted as 40, once
    assert dict(sonnet) == {
        "input": 20,
        "output": 95,
        "cacheRead": 750,
        "cacheWrite": 70,
        "totalTokens": 935,
    }
    assert responses == {
        "claude-sonnet-4-5-20250929": 3,
        "claude-haiku-4-5-20251001": 2,
        "claude-opus-4-5-20251101": 2,
    }
    tree = by_id()
    assert [tree[i]["claudeCode"]["responseLine"] for i in ("a1-0000", "a2-0000", "a3-0000")] == [
        0,
        1,
        2,
    ]
    assert tree["a2-0000"]["message"]["usage"]["output"] == 9
    assert tree["a3-0000"]["claudeCode"]["message"]["usage"]["output_tokens"] == 40  # raw kept


def test_compaction_boundary_and_summary_become_one_compaction() -> None:
    tree = by_id()
    compaction = tree["cs-0000"]
    assert compaction["type"] == "compaction"
    assert compaction["parentId"] == "y1-0000"  # the boundary's logicalParentUuid
    assert compaction["firstKeptEntryId"] == "cs-0000"  # Claude Code keeps nothing
    assert compaction["tokensBefore"] == 18250
    assert compaction["summary"].startswith("This session is being continued")
    assert compaction["details"]["claudeCode"]["boundary"]["compactMetadata"]["trigger"] == (
        "manual"
    )
    assert tree["u4-0000"]["parentId"] == "cs-0000"
    assert "c1-0000" not in tree


def test_sidechain_entries_are_kept_and_marked() -> None:
    tree = by_id()
    side = [e for e in tree.values() if e.get("claudeCode", {}).get("isSidechain")]
    assert [e["id"] for e in side] == ["s1-0000", "s2-0000", "s3-0000", "s4-0000"]
    assert all(e["claudeCode"]["agentId"] == "4a1f" for e in side)
    assert tree["s1-0000"]["parentId"] is None  # its own root, off the main chain
    assert tree["s3-0000"]["message"]["toolName"] == "Grep"


def test_several_tool_results_on_one_line_chain_under_its_uuid(tmp_path: Path) -> None:
    call = {"type": "tool_use", "input": {}}
    results = [
        {"type": "tool_result", "tool_use_id": "t1", "content": "one"},
        {"type": "tool_result", "tool_use_id": "t2", "content": "two"},
        {"type": "text", "text": "and more"},
    ]
    server = {"type": "server_tool_use", "id": "w", "name": "web_search", "input": {}}
    lines = [
        cc_line("user", "u", None, role="user", content="go"),
        cc_line(
            "assistant",
            "a",
            "u",
            id="m",
            role="assistant",
            model="x",
            content=[{**call, "id": "t1", "name": "A"}, {**call, "id": "t2", "name": "B"}],
            usage={"input_tokens": 1, "output_tokens": 2},
        ),
        cc_line("user", "r", "a", role="user", content=results),
        cc_line("assistant", "b", "r", role="assistant", model="x", content=[server], usage={}),
    ]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    entries = [p.entry for p in parse_claude_code(path, path.read_bytes()).entries]
    assert [(e["id"], e["parentId"]) for e in entries] == [
        ("u", None),
        ("a", "u"),
        ("r#1", "a"),
        ("r#2", "r#1"),
        ("r", "r#2"),
        ("b", "r"),
    ]
    assert [e["message"]["role"] for e in entries[2:5]] == ["toolResult", "toolResult", "user"]
    assert [e["message"]["toolName"] for e in entries[2:4]] == ["A", "B"]
    assert entries[5]["message"]["content"] == []
    assert entries[5]["claudeCode"]["message"]["content"] == [server]  # kept as written


def test_a_growing_file_only_ever_appends(tmp_path: Path) -> None:
    """Every prefix of the file parses to a prefix of the whole file's entries, so a
    re-import of a grown file appends and never rewrites."""
    data = SESSION.read_bytes()
    full = [(p.line, p.entry) for p in parse_claude_code(SESSION, SESSION.read_bytes()).entries]
    cuts = sorted({i + 1 for i, b in enumerate(data) if b == 0x0A} | {100, 5000, len(data) - 3})
    for cut in cuts:
        part = parse_claude_code(SESSION, data[:cut])
        got = [(p.line, p.entry) for p in part.entries]
        assert got == full[: len(got)], cut
        assert part.consumed_bytes <= cut
        assert data[: part.consumed_bytes].count(b"\n") >= (got[-1][0] if got else 0)


def test_a_trailing_boundary_waits_for_its_summary() -> None:
    data = SESSION.read_bytes()
    lines = data.split(b"\n")
    upto_boundary = b"\n".join(lines[:16]) + b"\n"
    parsed = parse_claude_code(SESSION, upto_boundary)
    assert parsed.entries[-1].entry["id"] == "y1-0000"
    assert parsed.consumed_bytes == len(b"\n".join(lines[:15]) + b"\n")
    assert parsed.incomplete_tail


def test_a_half_written_line_is_left_for_later() -> None:
    data = SESSION.read_bytes()
    parsed = parse_claude_code(SESSION, data[:-10])
    assert parsed.incomplete_tail
    assert parsed.entries[-1].entry["id"] == "u5-0000"


def test_a_broken_line_is_skipped_as_claude_code_skips_it() -> None:
    lines = SESSION.read_bytes().split(b"\n")
    data = b"\n".join([*lines[:3], b"{oops", *lines[3:]])
    parsed = parse_claude_code(SESSION, data)
    assert len(parsed.entries) == len(parse_claude_code(SESSION, SESSION.read_bytes()).entries)
    assert parsed.entries[3].line == 5


_usage = st.fixed_dictionaries(
    {},
    optional={
        "input_tokens": st.integers(0, 10**6),
        "output_tokens": st.integers(0, 10**6),
        "cache_read_input_tokens": st.integers(0, 10**6),
        "cache_creation_input_tokens": st.one_of(st.integers(0, 10**6), st.text(), st.none()),
    },
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["m1", "m2", "m3"]), _usage), max_size=12))
def test_usage_sums_to_each_responses_maximum(snapshots: list[tuple[str, Any]]) -> None:
    lines = [
        {
            **cc_line(
                "assistant",
                f"a{i}",
                f"a{i - 1}" if i else None,
                id=mid,
                role="assistant",
                model="x",
                content=[],
                usage=usage,
            ),
            "requestId": "r-" + mid,
        }
        for i, (mid, usage) in enumerate(snapshots)
    ]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    entries = parse_claude_code(Path("s.jsonl"), data).entries
    got: dict[str, int] = defaultdict(int)
    for p in entries:
        for key, value in p.entry["message"]["usage"].items():
            if key != "cost":
                got[key] += value
    want: dict[str, int] = defaultdict(int)
    for mid in {m for m, _ in snapshots}:
        for claude, pi in (
            ("input_tokens", "input"),
            ("output_tokens", "output"),
            ("cache_read_input_tokens", "cacheRead"),
            ("cache_creation_input_tokens", "cacheWrite"),
        ):
            values = [u.get(claude) for m, u in snapshots if m == mid]
            best = max((v for v in values if isinstance(v, int)), default=0)
            want[pi] += best
            want["totalTokens"] += best
    assert {k: v for k, v in got.items() if v} == {k: v for k, v in want.items() if v}


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
_line = st.fixed_dictionaries(
    {"type": st.sampled_from(["user", "assistant", "system", "summary", "progress", "x"])},
    optional={
        "uuid": st.sampled_from(["a", "b", "c", "d"]),
        "parentUuid": st.sampled_from(["a", "b", "c", "zz", None]),
        "subtype": st.just("compact_boundary"),
        "isCompactSummary": st.booleans(),
        "message": st.fixed_dictionaries(
            {}, optional={"content": _json, "usage": _json, "id": _json}
        ),
        "timestamp": st.one_of(st.text(max_size=30), st.integers()),
    },
)


def _strict_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True


@settings(max_examples=150, deadline=None)
@given(st.lists(_line, max_size=10))
@example([{"type": "user", "message": {"content": math.inf}}, {"type": "x"}])  # found by a run
@example([{"type": "x", "message": {"content": -math.inf}}])
def test_any_lines_give_a_well_formed_tree(lines: list[dict[str, Any]]) -> None:
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    # a line holding an infinity is not JSON (json.dumps writes ``Infinity``): it is skipped
    readable = [x for x in lines if _strict_json(x)]
    if readable and all(x["type"] == "x" for x in readable):
        with pytest.raises(ImportFormatError):
            parse_claude_code(Path("s.jsonl"), data)
        return
    parsed = parse_claude_code(Path("s.jsonl"), data)
    seen: set[str] = set()
    for p in parsed.entries:
        entry = p.entry
        assert isinstance(entry["id"], str) and entry["id"] not in seen
        assert entry["parentId"] is None or entry["parentId"] in seen
        seen.add(entry["id"])
        json.dumps(entry)


def same(a: Any, b: Any) -> bool:
    """The same JSON: key order counts, and 0 is not false nor 1.0 the integer 1."""
    return json.dumps(a) == json.dumps(b)


def entries_by_line(data: bytes) -> dict[int, list[dict[str, Any]]]:
    lines: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for p in parse_claude_code(Path("s.jsonl"), data).entries:
        lines[p.line].append(p.entry)
    return lines


def test_what_pi_has_no_place_for_is_kept_as_written() -> None:
    """The blocks a tester found dropped: each line's content comes back exactly."""
    contents = [
        [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
        [
            {"type": "text", "text": "see", "citations": [{"url": "u", "cited_text": "c"}]},
            {"type": "tool_use", "id": "t1", "name": "Bash", "input": "a string", "caller": {}},
        ],
        [
            {
                "type": "tool_result",
                "tool_use_id": "t1",
                "content": [{"type": "text", "text": "ok", "extra": 1}],
                "is_error": False,
                "cache_control": {"type": "ephemeral"},
            }
        ],
        None,
        {"weird": "dict"},
        [{"type": "tool_result", "tool_use_id": "t1", "content": 42}],
    ]
    kinds = ["user", "assistant", "user", "user", "user", "user"]
    lines = [
        cc_line(kind, f"u{i}", f"u{i - 1}" if i else None, role=kind, content=content)
        for i, (kind, content) in enumerate(zip(kinds, contents, strict=True))
    ]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    got = [line_content(entries) for entries in entries_by_line(data).values()]
    assert same(got, contents)
    # content the mapping gives back exactly is not stored twice
    plain = cc_line("user", "p", None, role="user", content=[{"type": "text", "text": "hi"}])
    (entry,) = entries_by_line(json.dumps(plain).encode() + b"\n")[1]
    assert "content" not in entry["claudeCode"]["message"]


_value = st.recursive(  # any JSON value a line can hold (JSON has no NaN nor infinities)
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)
_odd_keys = st.sampled_from(
    [
        *("type", "text", "id", "name", "input", "content", "is_error", "tool_use_id"),
        *("source", "signature", "data", "thinking", "cache_control", "citations", "caller"),
    ]
)
# any keys, mostly ones the mapping reads or knows, with values of any type
_extra = st.dictionaries(_odd_keys | st.text(max_size=4), _value, max_size=2)


def _block(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda extra: {**base, **extra}, st.one_of(st.just({}), _extra))


_text = st.text(max_size=8)
_mapped = st.one_of(
    _text.flatmap(lambda t: _block({"type": "text", "text": t})),
    _text.flatmap(
        lambda d: _block(
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": d}}
        )
    ),
    _text.flatmap(lambda t: _block({"type": "thinking", "thinking": t, "signature": "s"})),
    _text.flatmap(lambda d: _block({"type": "redacted_thinking", "data": d})),
    st.dictionaries(_text, _value, max_size=2).flatmap(
        lambda i: _block({"type": "tool_use", "id": "t", "name": "T", "input": i})
    ),
    _text,
    _value,
)
_result_content = st.one_of(_text, st.lists(_mapped, max_size=3), _value)
_tool_result = st.builds(
    lambda content, error, extra: {
        "tool_use_id": "t",
        "type": "tool_result",
        "content": content,
        **({"is_error": True} if error else {}),
        **extra,
    },
    _result_content,
    st.booleans(),
    st.one_of(st.just({}), _extra),
)
_content = st.one_of(_text, st.lists(st.one_of(_mapped, _tool_result), max_size=4), _value)


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["user", "assistant", "compaction"]),
    content=_content,
    tool_use_result=st.just({}) | _value.map(lambda v: {"toolUseResult": v}),
)
def test_every_content_comes_back_exactly(
    kind: str, content: Any, tool_use_result: dict[str, Any]
) -> None:
    """Whatever a line's ``message.content`` holds (blocks with extra keys, values of odd
    types, blocks pi has no shape for), it is recoverable from the entries the line became,
    and the rest of the line is in ``claudeCode``."""
    role = "user" if kind == "compaction" else kind
    line = {**cc_line(role, "x", None, role=role, content=content), **tool_use_result}
    lines = [line]
    if kind == "compaction":
        boundary = {"type": "system", "subtype": "compact_boundary", "uuid": "b"}
        lines = [boundary, {**line, "isCompactSummary": True}]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    (entries,) = entries_by_line(data).values()
    assert same(line_content(entries), content)
    last = entries[-1]
    meta = last["details"]["claudeCode"]["summary"] if kind == "compaction" else last["claudeCode"]
    rest = {k: v for k, v in meta["message"].items() if k != "content"}
    if "toolUseResult" in line and "toolUseResult" not in meta:  # on the one tool result
        (result,) = [e["message"] for e in entries if e["message"]["role"] == "toolResult"]
        meta = {**meta, "toolUseResult": result["details"]}
    want = {k: v for k, v in lines[-1].items() if k != "message"}
    assert same({k: meta[k] for k in want}, want) and set(meta) == {*want, "message"}
    assert same(rest, {"role": role})


@pytest.mark.parametrize("kind", ["user", "assistant"])
def test_a_message_line_without_content_is_kept_whole(kind: str) -> None:
    line = cc_line(kind, "x", None, role=kind)
    (entry,) = entries_by_line(json.dumps(line).encode() + b"\n")[1]
    assert entry["customType"] == f"claude-code.{kind}" and same(entry["data"], line)


def test_lines_that_are_not_objects_are_reported_by_line(tmp_path: Path) -> None:
    """Not JSON, or JSON but not an object: not imported, and reported with the line and
    why. A typeless object is kept (a custom entry holding the line)."""
    first = json.dumps(cc_line("user", "u1", None, role="user", content="hi"))
    odd = ['{"type":"user",BROKEN', "[1,2,3]", '"str"', "42", "null", '{"no":"type"}']
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join([first, *odd]) + "\n")
    parsed = parse_claude_code(path, path.read_bytes())
    assert [e.line for e in parsed.entries] == [1, 7]
    assert parsed.entries[1].entry["data"] == {"no": "type"}
    assert [(s.line, s.reason) for s in parsed.ignored_lines] == [
        (2, "not JSON"),
        *((n, "not a JSON object") for n in range(3, 7)),
    ]


def test_a_line_too_deep_to_read_is_refused_by_its_line(tmp_path: Path) -> None:
    first = json.dumps(cc_line("user", "u1", None, role="user", content="hi"))
    deep = '{"type":"progress","data":' + "[" * 2000 + "]" * 2000 + "}"
    path = tmp_path / "s.jsonl"
    path.write_text(f"{first}\n{deep}\n")
    with pytest.raises(ImportFormatError, match=r"s\.jsonl line 2: nested too deeply"):
        parse_claude_code(path, path.read_bytes())
    assert looks_like_claude_code(path, path.read_bytes())  # detection reads line 1 only


@pytest.mark.parametrize("zone", ["UTC", "Asia/Tokyo", "America/Los_Angeles"])
def test_a_time_without_an_offset_is_utc_wherever_the_import_runs(
    zone: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The same line gives the same entry under any local zone (it was read as the
    importing machine's local time); a year-1 time is read too (it aborted the run)."""
    monkeypatch.setenv("TZ", zone)
    time.tzset()
    try:
        stamps = ["2026-01-01T00:00:00", "2026-01-01T00:00:00Z", "0001-01-01T00:00:00"]
        lines = [cc_line("user", f"u{n}", None, role="user", content="hi") for n in range(3)]
        for line, stamp in zip(lines, stamps, strict=True):
            line["timestamp"] = stamp
        path = tmp_path / "s.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        parsed = parse_claude_code(path, path.read_bytes())
        millis = [e.entry["message"]["timestamp"] for e in parsed.entries]
        assert millis == [1767225600000, 1767225600000, -62135596800000]
    finally:
        monkeypatch.undo()
        time.tzset()


A = "7d3c5e2a-91f4-4b6e-8a0d-2c1f9e8b7a60"
B = "0b9e4f31-5c2d-4e8a-9f17-6a3b2c1d0e9f"
C = "11111111-2222-4333-8444-555555555555"


def _user_line(session: str, uuid: str, parent: str | None) -> str:
    message = {"role": "user", "content": uuid}
    return json.dumps(
        {"type": "user", "uuid": uuid, "parentUuid": parent, "sessionId": session}
        | {"timestamp": "2026-01-21T10:00:00Z", "message": message}
    )


@pytest.mark.parametrize(
    ("name", "sessions", "external", "parent", "former"),
    [
        (f"{A}.jsonl", [A], A, None, ()),
        # its own id in upper case: not its child (keyed by its name while no line said so)
        (f"{A.upper()}.jsonl", [A], A, None, (A.upper(),)),
        (f"{B}.jsonl", [A, B], B, A, (A,)),  # resumed from A
        (f"{C}.jsonl", [A, B, C], C, B, (A,)),  # resumed from B, which was resumed from A
        (f"{B}.jsonl", [A], B, A, (A,)),  # resumed, none of its own lines yet
        ("backup-of-b.jsonl", [A, B], B, A, ("backup-of-b", A)),  # a renamed copy of B: B
        ("copy.jsonl", [A], A, None, ("copy",)),
        ("resumed.jsonl", ["chat_7.v1", "x"], "x", "chat_7.v1", ("resumed", "chat_7.v1")),
        ("agent-4a1f.jsonl", [B], f"{B}/agent-4a1f", None, ("agent-4a1f",)),
        ("agent-4a1f.jsonl", [A, B], f"{B}/agent-4a1f", None, ("agent-4a1f", f"{A}/agent-4a1f")),
    ],
)
def test_a_file_is_the_session_its_name_says(
    name: str, sessions: list[str], external: str, parent: str | None, former: tuple[str, ...]
) -> None:
    """The key, the parent (by its id: never parsed as a path) and the keys an earlier
    pass may have given the file, under which an import finds a file imported then: its
    name, when no line named a session yet, and the first sessionId (before stop 37)."""
    lines = [_user_line(s, f"u{i}", f"u{i - 1}" if i else None) for i, s in enumerate(sessions)]
    header = parse_claude_code(Path(name), ("\n".join(lines) + "\n").encode()).header
    assert (header.external_id, header.parent_id, header.parent_session) == (external, parent, None)
    assert header.former_ids == former
