"""Structural checks on incoming events: one walk, and an error that names the field.

Documented limits (both are settings): at most ``max_batch_events`` events per append, and
objects/arrays nested at most ``max_event_depth`` levels deep inside one event.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from core import exact_json
from core.errors import InvalidArgument, InvalidEvent, WriteTooLarge
from core.journal.usage import check_usage

MAX_TYPE_LENGTH = 256


def pointer_token(key: str | int) -> str:
    """One RFC 6901 JSON-pointer token."""
    return str(key).replace("~", "~0").replace("/", "~1")


def check_batch(events: Sequence[Any], *, max_events: int, max_depth: int) -> list[bytes | None]:
    """Reject a bad batch; per event, its JSON when the fast check proved it plain."""
    check_batch_size(events, max_events=max_events)
    return [
        check_event(event, index=index, max_depth=max_depth) for index, event in enumerate(events)
    ]


def check_batch_size(events: Sequence[Any], *, max_events: int) -> None:
    if isinstance(events, (str, bytes, dict)) or not isinstance(events, Sequence):
        raise InvalidEvent("", f"events must be a list of objects, got {type(events).__name__}")
    if not events:
        raise InvalidEvent("", "a write needs at least one event")
    if len(events) > max_events:
        raise WriteTooLarge(
            "", f"batch of {len(events)} events exceeds the limit of {max_events} per write"
        )


@dataclass(frozen=True, slots=True, eq=False)
class CheckedEvents:
    """Events ``check_event`` accepted, each with its JSON where the check computed it: an
    append takes them without checking each event again (the import checks a whole pass
    before writing any of it, then appends it in batches). Only what ``checked`` returns;
    the caller must not change the events afterwards."""

    events: Sequence[Any]
    encoded: Sequence[bytes | None]

    def __len__(self) -> int:
        return len(self.events)

    def __getitem__(self, part: slice) -> CheckedEvents:
        return CheckedEvents(self.events[part], self.encoded[part])


def checked(events: Sequence[Any], *, max_depth: int) -> CheckedEvents:
    """``check_event`` on each of ``events`` (any number: batches are cut later)."""
    return CheckedEvents(
        events, [check_event(event, index=i, max_depth=max_depth) for i, event in enumerate(events)]
    )


class _Bad(Exception):
    """A rejection on its way up the walk; each frame prepends its key to the path."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.tokens: list[str] = []


def check_event(event: Any, *, index: int | None = None, max_depth: int) -> bytes | None:
    """Reject a bad event. Returns its JSON if ``plain_json`` accepted it (no walk needed),
    else None after the full walk (which names the offending field)."""
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
    check_usage(event, index=index)
    encoded = plain_json(event, max_depth=max_depth)
    if encoded is not None:
        return encoded
    try:
        _walk(event, 1, max_depth)
    except _Bad as bad:
        path = "".join(f"/{token}" for token in reversed(bad.tokens))
        raise InvalidEvent(path, bad.reason, index=index) from None
    return None


# orjson encodes these natively, but the walk rejects them: make orjson refuse them too.
_STRICT = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS
_NUL = b"\\u0000"


def plain_json(value: Any, *, max_depth: int) -> bytes | None:
    """``value`` as compact JSON if it certainly passes the walk below, else None.

    The fast path for ordinary events: orjson refuses non-string keys, lone surrogates,
    integers outside 64 bits (valid, but the walk and ``core.exact_json`` take those) and
    non-JSON types. What it would coerce (NaN and infinities become null, tuples and UUIDs
    and enums of other kinds change type) is caught by decoding the result again and
    comparing, all in C; a large event (mostly one long string: a screenshot, a tool's
    output) is instead checked node by node (``_plain``), which costs less than decoding
    and comparing all its bytes. A U+0000 anywhere, or more nesting than allowed, is left
    to the walk, which reports it with its path.
    """
    try:
        encoded = orjson.dumps(value, option=_STRICT)
    except TypeError:  # orjson.JSONEncodeError included
        return None
    if len(encoded) >= _CHECK_NODES_FROM:
        return encoded if _plain(value, 1, max_depth) else None
    if _NUL in encoded:
        return None
    copy = orjson.loads(encoded)
    if copy != value:
        return None
    # Each level needs an opening bracket, so few brackets bound the depth.
    if encoded.count(b"{") + encoded.count(b"[") > max_depth and _depth(copy) > max_depth:
        return None
    return encoded


# Decoding and comparing reads every byte; a check of the nodes costs what their number
# does. On the 200-turn session (``python -m bench.session200 --validation``: 1,010 events,
# 8.7 MB) validation 34 -> 22 ms with the larger events checked node by node (RESULTS.md).
_CHECK_NODES_FROM = 64 * 1024


def _plain(value: Any, depth: int, max_depth: int) -> bool:
    """Whether ``value``, which orjson encoded (so: string keys, no lone surrogates,
    integers inside 64 bits), is made of exact JSON types only, with finite floats, no
    U+0000 and no more than ``max_depth`` levels: what the walk accepts and orjson writes
    as it is."""
    kind = type(value)
    if kind is str:
        return "\x00" not in value
    if kind is dict:
        if depth > max_depth:
            return False
        for key, item in value.items():
            if type(key) is not str or "\x00" in key or not _plain(item, depth + 1, max_depth):
                return False
        return True
    if kind is list:
        if depth > max_depth:
            return False
        return all(_plain(item, depth + 1, max_depth) for item in value)
    if kind is float:
        return math.isfinite(value)
    return kind is int or kind is bool or value is None


def _depth(value: Any) -> int:
    """Nesting of objects/arrays in decoded JSON (only exact dicts and lists)."""
    children = value.values() if type(value) is dict else value
    return 1 + max((_depth(v) for v in children if type(v) in _NESTED), default=0)


_NESTED = frozenset({dict, list})


# The walk runs on every event of every write: paths are only built on the way up from a
# rejection, never on the happy path.
def _walk(value: Any, depth: int, max_depth: int) -> None:
    kind = type(value)
    if kind not in _CONTAINERS:
        # subclasses (OrderedDict, str enums, tuples) are walked as their JSON kind
        kind = next((k for k, base in _CONTAINERS.items() if isinstance(value, base)), kind)
    if kind is str:
        if not value.isascii():
            _check_text(value)
    elif kind is dict:
        if depth > max_depth:
            raise _Bad(f"nested deeper than the limit of {max_depth} levels")
        for key, item in value.items():
            if type(key) is not str:
                raise _Bad(f"object key {key!r} is not a string")
            try:
                if "\x00" in key:
                    raise _Bad("object keys cannot contain U+0000")
                if not key.isascii():
                    _check_text(key)
                if type(item) not in _PLAIN:
                    _walk(item, depth + 1, max_depth)
            except _Bad as bad:
                bad.tokens.append(pointer_token(key))
                raise
    elif kind is list:
        if depth > max_depth:
            raise _Bad(f"nested deeper than the limit of {max_depth} levels")
        for i, item in enumerate(value):
            try:
                if type(item) not in _PLAIN:
                    _walk(item, depth + 1, max_depth)
            except _Bad as bad:
                bad.tokens.append(str(i))
                raise
    else:
        _check_scalar(value)


_PLAIN = frozenset({bool, type(None)})
_CONTAINERS: dict[type, type | tuple[type, ...]] = {str: str, dict: dict, list: (list, tuple)}


def _check_scalar(value: Any) -> None:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        # beyond 64 bits core.exact_json stores and reads it back; beyond MAX_INT_BITS
        # Python's own JSON (the queue's, a reader's) cannot turn it into text or back
        if value.bit_length() > MAX_INT_BITS:
            raise _Bad(
                f"integer of {value.bit_length():,} bits: the limit is {MAX_INT_BITS:,} bits "
                "(about 4,000 digits), what every JSON reader of the journal can read back"
            )
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _Bad(f"{value!r} is not a JSON number")
    elif isinstance(value, str):
        _check_text(value)
    else:
        raise _Bad(f"{type(value).__name__} is not a JSON value")


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _Bad(f"string is not valid Unicode ({exc.reason})") from None


_INT64_MAX = 2**63 - 1
# 10**4000 < 2**13288: integers under it have at most 4,000 digits, inside Python's default
# int-to-text limit (sys.get_int_max_str_digits(), 4,300), which kombu's and the standard
# library's JSON and every reader in Python meet
MAX_INT_BITS = 13_288
MAX_ID_LENGTH = 36
MAX_TENANT_LENGTH = 128
MAX_KEY_LENGTH = 200


def check_write(
    session_id: Any,
    events: Any,
    *,
    expected_seq: Any = None,
    idempotency_key: Any = None,
    max_events: int,
    max_depth: int,
    max_bytes: int,
) -> int:
    """Everything a worker would refuse about a write, checked before it is published.

    Returns the write's JSON size. Raises ``InvalidEvent`` (or ``WriteTooLarge``) naming
    the field: the producer and the worker run this same function, so a write accepted
    here is one the journal can store.
    """
    check_id(session_id, "session_id", MAX_ID_LENGTH)
    if idempotency_key is not None:
        check_id(idempotency_key, "idempotency_key", MAX_KEY_LENGTH)
    if expected_seq is not None:
        check_seq(expected_seq, "expected_seq", error=InvalidEvent)
    encoded = check_batch(events, max_events=max_events, max_depth=max_depth)
    size = 2 + len(encoded) - 1
    for part, event in zip(encoded, events, strict=True):
        size += len(part) if part is not None else len(_json_bytes(event))
    if size > max_bytes:
        raise WriteTooLarge("", f"write of {size:,} bytes exceeds the limit of {max_bytes:,} bytes")
    return size


def check_seq(value: Any, field: str, *, error: type[InvalidEvent] = InvalidArgument) -> None:
    """A seq or position argument fits the journal's BIGINT columns (a bool is no number).
    A write's ``expected_seq`` is refused as the write's ``InvalidEvent``: the name its
    outcome and dead letter carry to producers."""
    if type(value) is not int or not 0 <= value <= _INT64_MAX:
        raise error(field, f"must be an integer in 0..2^63-1, not {value!r}")


def check_limit(value: Any, field: str = "limit") -> int:
    """A page size: an integer of at least 1, on every read that takes one (0 would make a
    follower that pages by it stand still; a bool is no number). A larger one than a call
    returns at once is cut to that call's page."""
    if type(value) is not int or not 1 <= value <= _INT64_MAX:
        raise InvalidArgument(field, f"must be an integer in 1..2^63-1, not {value!r}")
    return value


def check_names(values: Any, field: str) -> None:
    """A list of names (types, roles) to match: each as ``check_name`` checks it. A string
    alone is refused: iterated, it was its characters, and the query matched nothing."""
    if isinstance(values, (str, bytes)):
        raise InvalidArgument(field, f"must be a list of names, not one string: [{values!r}]")
    for value in values or ():
        check_name(value, field)


def check_name(value: Any, field: str) -> None:
    """An id, tenant, type or path argument a query compares: no U+0000 (PostgreSQL's text
    cannot hold one, so the driver failed where SQLite matched nothing), and no lone
    surrogate (what Python makes of a command-line byte that is not UTF-8: no database
    text holds one, and the driver's codec error named neither the argument nor why)."""
    if not isinstance(value, str):
        return
    if "\x00" in value:
        raise InvalidArgument(field, "cannot contain U+0000")
    if exact_json.LONE_SURROGATE.search(value):
        raise InvalidArgument(
            field, "is not UTF-8 text (a lone surrogate: a byte that is not UTF-8, as given)"
        )


_MAX_SECONDS = 10**10  # ~317 years: any age a caller means; now minus it is still a date


def check_seconds(value: Any, field: str) -> float:
    """An age or grace in seconds: a finite number from 0 (a bool is no number)."""
    if type(value) not in (int, float) or not 0 <= value <= _MAX_SECONDS:  # NaN fails too
        raise InvalidArgument(field, f"must be a number of seconds in 0..1e10, not {value!r}")
    return float(value)


def check_at_seq(at_seq: Any, head_seq: int) -> int:
    """``at_seq`` (None: the head), checked to be a seq from 0 to the head."""
    if at_seq is None:
        return head_seq
    if type(at_seq) is not int or not 0 <= at_seq <= head_seq:
        raise InvalidArgument("at_seq", f"must be from 0 to the head ({head_seq}), not {at_seq!r}")
    return at_seq


def check_id(value: Any, field: str, max_length: int) -> None:
    if type(value) is not str:
        raise InvalidEvent(field, f"must be a string, got {type(value).__name__}")
    if not 0 < len(value) <= max_length:
        raise InvalidEvent(field, f"must be 1..{max_length} characters")
    if "\x00" in value:
        raise InvalidEvent(field, "cannot contain U+0000")
    try:
        _check_text(value)
    except _Bad as bad:
        raise InvalidEvent(field, bad.reason) from None


def _json_bytes(event: Any) -> bytes:
    """An event the walk accepted, as JSON (subclasses and NUL included)."""
    try:
        return exact_json.dumps(event)  # integers of any size are values too (invariant 11)
    except (TypeError, ValueError) as exc:  # the walk accepts only JSON kinds
        raise InvalidEvent("", f"cannot be encoded as JSON ({exc})") from None
