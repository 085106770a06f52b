"""Odd values in any field of a pi or Claude Code file never escape as an untyped error:
the file is read (as pi or Claude Code would read it) or refused with a typed error, so a
run over many files reports it and goes on (Hypothesis, plus the cases found before)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import ImportFormatError, SessionStoreError
from core.interop import importer, pi
from core.interop.claude_code import parse_claude_code
from core.interop.model import ParsedSession

# markers written as raw JSON text: 1e999 (JSON.parse: Infinity; Python's writer cannot),
# and an array 990 levels deep (both Python writers recurse past their limit)
_INFINITY = "<1e999>"
_DEEP = "<deep990>"
_RAW = {_INFINITY: "1e999", _DEEP: "[" * 990 + "]" * 990}


SPECIAL = st.sampled_from(
    [
        _INFINITY,
        2**1100,  # beyond a double
        -(2**1100),
        "0x" + "f" * 300,
        "0b" + "1" * 1100,
        " 3 ",
        "Infinity",
        "-Infinity",
        "",
        "0001-01-01T00:00:00",
        "0001-01-01T00:00:00+14:00",
        "9999-12-31T23:59:59",
        "9999-12-31T23:59:59-14:00",
        "2026-01-01T00:00:00Z",
        "session",
        "\x00",
        {"toString": 1},
        _DEEP,
        [[[3]]],
        -0.0,
        1e308,
    ]
)
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | SPECIAL
)
VALUE = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=10,
)


# a field's value: one of the values that broke a reader before, half the time
FIELD = SPECIAL | VALUE


def _fields(names: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional={name: FIELD for name in names})


def _line(value: Any) -> str:
    text = json.dumps(value)
    for marker, raw in _RAW.items():
        text = text.replace(json.dumps(marker), raw)
    return text


def _typed_or_read(parse: Any, lines: list[Any]) -> None:
    data = ("\n".join(map(_line, lines)) + "\n").encode()
    try:
        parsed = parse(Path("odd.jsonl"), data)
    except SessionStoreError:
        return
    assert isinstance(parsed, ParsedSession)


PI_HEADER = ["version", "timestamp", "cwd", "parentSession"]
PI_ENTRY = ["type", "id", "parentId", "timestamp", "firstKeptEntryIndex", "message", "summary"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    header=_fields(PI_HEADER),
    entries=st.lists(
        _fields(PI_ENTRY)
        | st.builds(lambda kept: {"type": "compaction", "firstKeptEntryIndex": kept}, FIELD)
        | FIELD,
        max_size=4,
    ),
)
def test_pi_reader_never_raises_untyped(header: dict[str, Any], entries: list[Any]) -> None:
    _typed_or_read(pi.parse, [{"type": "session", "id": "h", **header}, *entries])


@settings(max_examples=100, deadline=None)
@given(header=_fields(["type", "id", *PI_HEADER]), entries=st.lists(FIELD, max_size=3))
def test_pi_reader_never_raises_untyped_on_any_header(
    header: dict[str, Any], entries: list[Any]
) -> None:
    _typed_or_read(pi.parse, [header, *entries])


CC_LINE = [
    "type",
    "uuid",
    "parentUuid",
    "sessionId",
    "cwd",
    "timestamp",
    "message",
    "subtype",
    "isCompactSummary",
    "compactMetadata",
    "logicalParentUuid",
    "toolUseResult",
    "requestId",
    "isApiErrorMessage",
    "summary",
    "leafUuid",
    "customTitle",
]
CC_BLOCK = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            ["text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"]
        )
        | FIELD
    },
    optional={
        k: FIELD
        for k in (
            *("text", "source", "id", "name", "input", "tool_use_id", "content"),
            *("is_error", "thinking", "signature", "data"),
        )
    },
)
CC_MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": FIELD,
        "content": FIELD | st.lists(CC_BLOCK | FIELD, max_size=3),
        "model": FIELD,
        "id": FIELD,
        "usage": FIELD | _fields(["input_tokens", "output_tokens"]),
        "stop_reason": FIELD,
    },
)
CC_KIND = st.sampled_from(["user", "assistant", "system", "summary", "custom-title"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lines=st.lists(
        st.tuples(CC_KIND | FIELD, _fields(CC_LINE), CC_MESSAGE | FIELD).map(
            lambda t: {**t[1], "type": t[0], "message": t[2]}
        )
        | FIELD,
        min_size=1,
        max_size=4,
    )
)
def test_claude_code_reader_never_raises_untyped(lines: list[Any]) -> None:
    _typed_or_read(parse_claude_code, lines)


def test_the_cases_found_before_are_read_as_pi_and_claude_code_read_them() -> None:
    hexed = pi.parse(
        Path("x"),
        _line({"type": "session", "version": "0x" + "f" * 300, "id": "h"}).encode() + b"\n",
    )
    assert hexed.header.version == 3  # Number("0xfff…") is Infinity: pi migrates nothing
    for wide, version in ((2**1100, 3), (-(2**1100), 1)):  # JSON.parse: ±Infinity
        header = _line({"type": "session", "version": wide, "id": "h"}) + "\n"
        assert pi.parse(Path("x"), header.encode()).header.version == version
    deep = pi.parse(
        Path("x"), (_line({"type": "session", "version": _DEEP, "id": "h"}) + "\n").encode()
    )
    assert deep.header.version == 1 and deep.header.raw["version"] == 3  # String() is ""
    v1 = [{"type": "session", "id": "h"}, {"type": "compaction", "firstKeptEntryIndex": _INFINITY}]
    [compaction] = pi.parse(Path("x"), ("\n".join(map(_line, v1)) + "\n").encode()).entries
    assert (
        "firstKeptEntryIndex" not in compaction.entry and "firstKeptEntryId" not in compaction.entry
    )
    cc = {"type": "user", "uuid": "u", "sessionId": "s", "timestamp": "0001-01-01T00:00:00"}
    cc["message"] = {"role": "user", "content": "hi"}
    [entry] = parse_claude_code(Path("x"), (_line(cc) + "\n").encode()).entries
    assert entry.entry["message"]["timestamp"] == -62135596800000
    with pytest.raises(ImportFormatError, match="no line of this file is a Claude Code"):
        parse_claude_code(Path("x"), b'{"type":["user"],"uuid":"u2"}\n')
    assert math.isinf(pi._js_to_number("0x" + "f" * 300))


def test_a_converter_that_fails_is_a_typed_error_naming_the_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A converter (a plugin's too) that raises on odd input: the file's typed error."""

    def broken(path: Path, data: bytes) -> ParsedSession:
        raise TypeError("unhashable type: 'list'")

    converters = importer.converters()  # loads the plugins first
    monkeypatch.setitem(
        importer._CONVERTERS, "broken", importer.Converter("broken", broken, lambda p, d: False)
    )
    assert "broken" not in converters
    with pytest.raises(ImportFormatError, match=r"odd\.jsonl.*the broken reader failed.*TypeError"):
        importer.parse_file_data(Path("odd.jsonl"), b"{}\n", format="broken")
