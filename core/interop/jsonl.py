"""Reading an agent's JSONL session file while the agent may still be writing it.

Only complete lines (ending in a newline) are parsed: a last line without its newline is an
agent mid-write, left for the next pass. Blank lines are skipped but still counted, so line
numbers are the file's own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import ImportFormatError


@dataclass(frozen=True, slots=True)
class JsonLine:
    number: int  # 1-based line of the file
    start: int  # byte offset of the line's first byte
    end: int  # byte offset just after its newline
    value: dict[str, Any]


@dataclass(frozen=True, slots=True)
class JsonLines:
    lines: list[JsonLine]
    consumed_bytes: int  # up to and including the last newline
    incomplete_tail: bool  # bytes after the last newline (not parsed)


def read_json_lines(path: Path, *, data: bytes | None = None) -> JsonLines:
    """Every complete line of ``path`` as a JSON object (``ImportFormatError`` otherwise)."""
    raw = path.read_bytes() if data is None else data
    complete = raw.rfind(b"\n") + 1
    lines: list[JsonLine] = []
    offset = 0
    for number, text in enumerate(raw[:complete].split(b"\n")[:-1], start=1):
        start, offset = offset, offset + len(text) + 1
        if not text.strip():
            continue
        lines.append(JsonLine(number, start, offset, _parse(path, number, text)))
    return JsonLines(lines, complete, complete < len(raw))


def _parse(path: Path, number: int, text: bytes) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:  # UnicodeDecodeError is a ValueError too
        raise ImportFormatError(f"{path}:{number}", f"not a JSON line: {exc}") from None
    if not isinstance(value, dict):
        raise ImportFormatError(f"{path}:{number}", "a line must be a JSON object")
    return value


def head_objects(path: Path, *, max_bytes: int = 65536, max_lines: int = 20) -> list[Any]:
    """The first complete lines that parse as JSON (for format detection); never raises on
    content, only on I/O."""
    with path.open("rb") as handle:
        head = handle.read(max_bytes)
    found: list[Any] = []
    for text in head.split(b"\n")[:-1][:max_lines]:
        if not text.strip():
            continue
        try:
            found.append(json.loads(text))
        except ValueError:
            return found
    return found
