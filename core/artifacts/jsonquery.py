"""The small jq-like query language of ``agent://<id>?q=…`` and ``agent://<id>/<path>``.

``.a.b[0]``, ``["odd key"]`` and ``['odd key']`` walk objects and arrays; a path
``/a/b/0`` is the query ``.a.b[0]``. A step that does not exist yields None (``null``).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

from core.errors import ResolveError

_IDENT_CHARS = re.compile(r"[A-Za-z0-9_-]+")
_DIGITS = re.compile(r"^[0-9]+$")

Token = str | int


def parse_query(query: str) -> list[Token]:
    """``.foo.bar[0]["x y"]`` -> ``["foo", "bar", 0, "x y"]``."""
    text = query.strip()
    tokens: list[Token] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == ".":
            i += 1
        elif ch == "[":
            token, i = _bracket(text, i, query)
            tokens.append(token)
        else:
            match = _IDENT_CHARS.match(text, i)
            if match is None:
                raise ResolveError(f"Invalid query: unexpected {ch!r} in {query}")
            tokens.append(match.group())
            i = match.end()
    return tokens


def _bracket(text: str, start: int, query: str) -> tuple[Token, int]:
    i = start + 1
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] in "\"'":
        return _quoted(text, i, query)
    close = text.find("]", start + 1)
    if close == -1:
        raise ResolveError(f"Invalid query: missing ] in {query}")
    raw = text[start + 1 : close].strip()
    if not raw:
        raise ResolveError(f"Invalid query: empty [] in {query}")
    return (int(raw) if _DIGITS.match(raw) else raw), close + 1


def _quoted(text: str, start: int, query: str) -> tuple[Token, int]:
    """A quoted key inside brackets; backslash escapes the quote or a backslash."""
    quote = text[start]
    chars: list[str] = []
    i = start + 1
    while i < len(text) and text[i] != quote:
        if text[i] == "\\" and i + 1 < len(text):
            i += 1
        chars.append(text[i])
        i += 1
    close = i + 1
    while close < len(text) and text[close] == " ":
        close += 1
    if i >= len(text) or close >= len(text) or text[close] != "]":
        raise ResolveError(f"Invalid query: unterminated [{quote}…{quote}] in {query}")
    return "".join(chars), close + 1


def apply_query(data: Any, query: str) -> Any:
    current = data
    for token in parse_query(query):
        if isinstance(token, int):
            if not isinstance(current, list) or token >= len(current):
                return None
            current = current[token]
        elif isinstance(current, dict):
            current = current.get(token)
        else:
            return None
        if current is None:
            return None
    return current


def path_to_query(path: str) -> str:
    """``/a/b/0`` -> ``.a.b[0]``; odd segments become ``['…']``."""
    parts: list[str] = []
    for segment in (s for s in path.split("/") if s):
        decoded = unquote(segment)
        if _DIGITS.match(decoded):
            parts.append(f"[{decoded}]")
        elif _IDENT_CHARS.fullmatch(decoded):
            parts.append(f".{decoded}")
        else:
            escaped = decoded.replace("\\", "\\\\").replace("'", "\\'")
            parts.append(f"['{escaped}']")
    return "".join(parts)
