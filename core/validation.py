"""Structural checks on incoming events: one walk, and an error that names the field.

Documented limits (both are settings): at most ``max_batch_events`` events per append, and
objects/arrays nested at most ``max_event_depth`` levels deep inside one event.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from core.errors import InvalidEvent, WriteTooLarge

_INT64_MIN = -(2**63)
_UINT64_MAX = 2**64 - 1
MAX_TYPE_LENGTH = 256


def pointer_token(key: str | int) -> str:
    """One RFC 6901 JSON-pointer token."""
    return str(key).replace("~", "~0").replace("/", "~1")


def check_batch(events: Sequence[Any], *, max_events: int, max_depth: int) -> None:
    if isinstance(events, (str, bytes, dict)) or not isinstance(events, Sequence):
        raise InvalidEvent("", f"events must be a list of objects, got {type(events).__name__}")
    if not events:
        raise InvalidEvent("", "a write needs at least one event")
    if len(events) > max_events:
        raise WriteTooLarge(
            "", f"batch of {len(events)} events exceeds the limit of {max_events} per write"
        )
    for index, event in enumerate(events):
        check_event(event, index=index, max_depth=max_depth)


def check_event(event: Any, *, index: int | None = None, max_depth: int) -> None:
    if not isinstance(event, dict):
        raise InvalidEvent(
            "", f"an event must be a JSON object, got {type(event).__name__}", index=index
        )
    kind = event.get("type")
    if "type" not in event:
        raise InvalidEvent("/type", "missing: every event needs a string 'type'", index=index)
    if not isinstance(kind, str):
        raise InvalidEvent("/type", f"must be a string, got {type(kind).__name__}", index=index)
    if not kind or len(kind) > MAX_TYPE_LENGTH or "\x00" in kind:
        raise InvalidEvent(
            "/type", f"must be 1..{MAX_TYPE_LENGTH} characters without NUL", index=index
        )
    try:
        _walk(event, "", 1, max_depth)
    except InvalidEvent as exc:
        raise InvalidEvent(exc.field, exc.reason, index=index) from None


def _walk(value: Any, path: str, depth: int, max_depth: int) -> None:
    if isinstance(value, dict):
        if depth > max_depth:
            raise InvalidEvent(path, f"nested deeper than the limit of {max_depth} levels")
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidEvent(path, f"object key {key!r} is not a string")
            child = f"{path}/{pointer_token(key)}"
            if "\x00" in key:
                raise InvalidEvent(child, "object keys cannot contain U+0000")
            _check_text(key, child)
            _walk(item, child, depth + 1, max_depth)
    elif isinstance(value, list):
        if depth > max_depth:
            raise InvalidEvent(path, f"nested deeper than the limit of {max_depth} levels")
        for i, item in enumerate(value):
            _walk(item, f"{path}/{i}", depth + 1, max_depth)
    elif isinstance(value, str):
        _check_text(value, path)
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        if not _INT64_MIN <= value <= _UINT64_MAX:
            raise InvalidEvent(path, "integer outside the 64-bit range JSON consumers can read")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidEvent(path, f"{value!r} is not a JSON number")
    else:
        raise InvalidEvent(path, f"{type(value).__name__} is not a JSON value")


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidEvent(path, f"string is not valid Unicode ({exc.reason})") from None
