"""JSON text that reads back as exactly the value written (DESIGN invariant 11).

The journal stores each payload as its JSON text (PostgreSQL ``json``, SQLite ``TEXT``), so
key order, ``-0.0``, integral floats such as ``1e16`` and wide integers (validation admits
up to ``MAX_INT_BITS``, about 4,000 digits) survive on both backends. The text is orjson's,
which is fast and exact for everything but integers beyond 64 bits: orjson refuses to
encode those, and on decoding turns them into floats without a word. Such a value is
therefore encoded by the standard library instead, with a space as its second character
(``{ "n":…``: valid JSON, never orjson's output, and kept by PostgreSQL's ``json`` type and
``json_array_elements``, which a leading space would not be). A reader decodes such a text
with the standard library and every other text with orjson: one byte tells them apart, so
the common path pays nothing for the rare one.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson

# A lone surrogate: what a JSON ``\ud800`` escape holds, or what ``os.fsdecode`` makes of a
# byte that is not UTF-8 (U+DC80-U+DCFF). No database stores one, and no terminal shows one.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")

_MARK = b" "
_MARK_STR = " "


def escape_lone_surrogates(text: str) -> str:
    """JSON text (as ``json.dumps(..., ensure_ascii=False)`` writes it) with each lone
    surrogate written as its ``\\uXXXX`` escape, as ``JSON.stringify`` writes it: the text is
    then valid UTF-8, and ``json.loads`` reads the surrogate back. Outside its strings JSON
    text is ASCII, so every surrogate is inside one."""
    return LONE_SURROGATE.sub(lambda m: f"\\u{ord(m[0]):04x}", text)


def dumps(value: Any) -> bytes:
    """Compact JSON of a validated value; wide integers and lone surrogates go the standard
    library's way."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        # What orjson refuses here is an integer outside 64 bits (the validator let the
        # value through) or a lone surrogate (no payload holds one; a fold read it from a
        # kept line, and its snapshot keeps it); the stdlib writes those (and floats as their
        # repr, which both decoders read back as the same float).
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        encoded = escape_lone_surrogates(text).encode("utf-8")
        if encoded[:1] in (b"{", b"["):
            return encoded[:1] + _MARK + encoded[1:]
        return _MARK + _MARK + encoded  # a bare value: leading whitespace is JSON too


def dumps_str(value: Any) -> str:
    return dumps(value).decode("utf-8")


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """The value of JSON text written by ``dumps`` (or any JSON without wide integers)."""
    if data[1:2] in (_MARK, _MARK_STR):
        return json.loads(bytes(data) if isinstance(data, memoryview) else data)
    return orjson.loads(data)


def same_value(a: Any, b: Any) -> bool:
    """Whether two decoded JSON values are the same JSON, which Python's ``==`` does not
    tell: ``true`` is not ``1``, ``1`` is not ``1.0``, ``-0.0`` is not ``0.0``. Key order is
    not part of an object's value."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return bool(a == b)
