"""pi session files (JSONL, versions 1-3): read with pi's own migration rules, write version 3.

pi's format (``packages/coding-agent/docs/session.md`` in badlogic/pi-mono): the first line is
a ``{"type": "session", "id", "timestamp", "cwd", "version"?}`` header, then one entry per line.
When pi opens an older file it migrates it in place, and we apply the same rules so that our
journal holds what pi itself would see:

- v1 -> v2: every entry gets an ``id`` and a ``parentId`` chaining it to the entry before
  (linear); a compaction's ``firstKeptEntryIndex`` (an index into the file's parsed lines,
  header included) becomes ``firstKeptEntryId``;
- v2 -> v3: a message with role ``hookMessage`` gets role ``custom``;
- the header's ``version`` becomes 3.

pi draws v1 ids at random (8 hex characters); ours are derived from the header id and the
entry's index, so a re-import of the same file gives the same ids (idempotency needs that).
Keys are added as JavaScript adds them (at the end of the object), so the key order of a
migrated entry is pi's too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import orjson

from core.blobs.externalize import TRANSIENT_FIELDS
from core.blobs.store import BLOB_REF_PREFIX, looks_like_ref
from core.errors import ImportFormatError
from core.exact_json import LONE_SURROGATE, escape_lone_surrogates
from core.interop.model import IgnoredLine, ParsedEntry, ParsedSession, SessionHeader
from core.journal.validation import MAX_TYPE_LENGTH

log = logging.getLogger(__name__)

CURRENT_VERSION = 3
HEADER_TYPE = "session"
# why a line holds no entry (``ParsedSession.ignored_lines``)
NOT_JSON = "not JSON"
NOT_AN_OBJECT = "not a JSON object"
# Lines pi keeps that the journal cannot hold as they are, kept in an event of these types
# and written back as they were (``line_text``):
# - an object without a string ``type`` the journal holds (1..256 characters, no U+0000):
#   ``{"type": UNTYPED_LINE, "line": the object}``, in pi's tree by the object's id and
#   parentId;
# - a line holding a lone surrogate (``"\ud800"``, which JSON.stringify writes for a string
#   cut inside an emoji; no database text holds one): ``{"type": ESCAPED_LINE, "id",
#   "parentId", "value": the line escaped}`` (``escaped_line``); its id and parentId (those
#   without a lone surrogate) place it in pi's tree. Events stored before the escape (and a
#   line nested too deeply for it) hold ``"json": the line as dumps_exact writes it`` instead.
#   So is a line with an image block whose ``data`` reads as a blob ref (``holds_ref_image``):
#   the journal would take the text for a ref to a blob of the store.
UNTYPED_LINE = "sessionstore.untyped_line"
ESCAPED_LINE = "sessionstore.escaped_line"
# An escaped line's ``value`` is the line with only what the journal cannot keep as it is
# escaped, so each of its strings is stored on its own (a long one as a blob, as any event's)
# and the fold reads its fields:
# - a string holding a lone surrogate: ``{ESCAPED_STRING: pieces}``, its runs without one
#   (strings) and each lone surrogate (its code point, an int), in order;
# - an object with a key no stored object holds as it is (a lone surrogate or U+0000 in it,
#   one the externalizer drops, or one of these two names), or an image block whose data
#   reads as a blob ref: ``{ESCAPED_OBJECT: [key, value, key, value, ...]}``, its members in
#   order, each key escaped as a string is.
# Every other value is itself. No object of ``value`` but an escape has either name as a key,
# so undoing the escape (``unescaped``) gives back exactly the line.
ESCAPED_STRING = "sessionstore.escaped_string"
ESCAPED_OBJECT = "sessionstore.escaped_object"
_ESCAPED_KEYS = frozenset({ESCAPED_STRING, ESCAPED_OBJECT, *TRANSIENT_FIELDS})
# The deepest event an escaped line is kept as ``value`` in (``max_event_depth``'s default):
# a line whose escape nests deeper is kept as its text, as before the escape.
ESCAPED_MAX_DEPTH = 64


# reading ---------------------------------------------------------------------------------


class NestedTooDeeply(ValueError):
    """A line nested past the depth the exact reader can follow (~1,000 levels): it is JSON,
    so it is refused by name, never skipped as a line that is not JSON."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # JSON.parse refuses NaN and Infinity too


# orjson reads an integer beyond 64 bits as a float, silently; such a float's magnitude is at
# least 2**63, and its literal a run of 19 or more digits. A value holding such a float whose
# line holds such a run (rare) is read again by the standard library, which keeps integers
# exact. Looking for the float first costs a twentieth of what searching every line for the
# digits did (as much as the decoding itself); a float like 1e300 alone changes nothing.
_WIDE = 2.0**63
_LONG_DIGITS = re.compile(rb"\d{19}")


def loads_exact(line: bytes | str) -> Any:
    """One JSON value with every number kept: orjson for speed, the standard library for
    what orjson refuses or rounds (integers beyond 64 bits, lone surrogates)."""
    if isinstance(line, str):
        line = line.encode()
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        pass
    else:
        if not _holds_wide_float(value) or _LONG_DIGITS.search(line) is None:
            return value
    # strict UTF-8 (UnicodeDecodeError): json.loads(bytes) would pass encoded surrogates
    text = line.decode("utf-8")
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:  # the standard library's reader recurses: ~1,000 levels at most
        raise NestedTooDeeply("nested too deeply to be read exactly") from None


def _holds_wide_float(value: Any) -> bool:
    """Whether a decoded value holds a float that may be a rounded wide integer."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is dict:
            stack.extend(item.values())
        elif kind is list:
            stack.extend(item)
        elif kind is float and not -_WIDE < item < _WIDE:
            return True
    return False


def dumps_exact(value: Any) -> str:
    """Compact JSON as ``JSON.stringify`` writes it: same separators, no ASCII escaping,
    and a lone surrogate escaped as ``\\uXXXX`` (so the line is valid UTF-8)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # integers beyond 64 bits, lone surrogates
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        return escape_lone_surrogates(text)


def split_lines(data: bytes) -> tuple[list[tuple[int, bytes]], int, bool]:
    """The complete lines of ``data`` as (1-based line number, bytes), the bytes they span,
    and whether an unterminated tail was left (for the next pass).

    A last line without its newline is complete when it is a whole JSON object, as pi reads
    it (``trim().split("\n")``): a file written by hand or by another tool need not end in a
    newline. Nothing half written passes for one (no proper prefix of an object's text is a
    JSON object), and a writer that sends the newline on its own leaves a blank line after it.
    """
    body = trimmed_end(data)  # what pi's ``trim()`` keeps ends there: the last line too
    end = data.rfind(b"\n") + 1
    if body < end:  # the last line ended, and only JavaScript whitespace came after it
        last = data.rfind(b"\n", 0, body) + 1
        lines = [(n, raw) for n, raw in enumerate(data[:last].split(b"\n")[:-1], start=1)]
        return [*lines, (len(lines) + 1, data[last:body])], end, False
    lines = [(n, raw) for n, raw in enumerate(data[:end].split(b"\n")[:-1], start=1)]
    tail = data[end:body]
    if not tail.strip():
        return lines, end, False
    # the file's only line: pi's trim() drops what comes before it (a byte order mark)
    if _whole_object(data[max(end, _leading_space(data)) : body]):
        lines.append((len(lines) + 1, tail))
        return lines, len(data), False
    return lines, end, True


def trimmed_end(data: bytes) -> int:
    """Where ``data`` ends once the JavaScript whitespace at its end is dropped, as pi's
    ``content.trim()`` drops it (a no-break space, U+2028, a byte order mark, a vertical
    tab...): the file's last line ends there, so such a character after it does not make
    it malformed nor leave it waiting for a newline. (A complete UTF-8 encoding at the end
    is that character: no lead byte is ever a continuation byte.)"""
    end = len(data)
    while end:
        for space in _JS_SPACE_BYTES:
            if data.endswith(space, 0, end):
                end -= len(space)
                break
        else:
            return end
    return end


def _leading_space(data: bytes) -> int:
    """How many bytes at the start of ``data`` pi's ``content.trim()`` drops."""
    lead = _LEADING_JS_SPACE.match(data)
    return lead.end() if lead else 0


def not_started(data: bytes) -> bool | None:
    """Whether a file holds no line yet, as pi reads it: None when it holds one (whatever
    it is: its format says); True when it holds nothing but JavaScript whitespace (a byte
    order mark among it); False when it holds only the start of a first line, with no line
    break: text that more text could still make a JSON object (an agent writes a large
    first line in pieces). Text that no more text makes one (a crash's NULs, a second
    object after the first, ``{garbage``, UTF-16) is a line, of no format."""
    start, body = _leading_space(data), trimmed_end(data)
    if start >= body:
        return True
    if data.find(b"\n", start) >= 0:  # a line break: a line was written, whatever it holds
        return None
    # untrimmed at its end: a tab there may be inside a string, where JSON holds none
    return False if _object_prefix(data[start:]) else None


def _object_prefix(text: bytes) -> bool:
    """Whether ``text`` is the start of a JSON object's text (RFC 8259, as pi's
    ``JSON.parse`` reads it), not the whole of it. Bytes of invalid UTF-8 count as
    characters of a string, as pi reads them (U+FFFD).

    The C decoder reads it (no value built: numbers as their length, JSON's missing NaN and
    Infinity refused): all it read before it stopped is valid, so the text is such a start
    when it stopped at the end, inside a string, or in a token that more text completes.
    Too deep for it, the text is read token by token (``_grammar_prefix``)."""
    if not text.startswith(b"{"):
        return False
    doc = text.decode("utf-8", "replace")
    try:
        _DECODER.raw_decode(doc)
    except RecursionError:
        return _grammar_prefix(text)
    except json.JSONDecodeError as exc:
        return _ran_out(exc)
    except _NotJson:
        return False
    return False  # a whole object (whatever follows it): a line


class _NotJson(ValueError):
    """NaN, Infinity or -Infinity: Python's decoder reads them, JSON has none."""


def _no_constant(name: str) -> Any:
    raise _NotJson(name)


_DECODER = json.JSONDecoder(parse_int=len, parse_float=len, parse_constant=_no_constant)


def _ran_out(exc: json.JSONDecodeError) -> bool:
    """Whether the decoder stopped only because the text ended: where a value, a name or a
    delimiter was next; in a string; in a ``\\u`` escape, a literal or a number begun."""
    if exc.pos == len(exc.doc) or exc.msg.startswith("Unterminated string"):
        return True
    if exc.msg == "Invalid \\uXXXX escape":  # at its ``u``
        return _PARTIAL_ESCAPE.fullmatch(exc.doc, exc.pos) is not None
    if exc.msg == "Expecting value":  # a literal begun (``tr``), or a number (``-``)
        return _PARTIAL_VALUE_TEXT.fullmatch(exc.doc, exc.pos) is not None
    if exc.msg == "Expecting ',' delimiter":  # a number read as far as it goes (``1.``)
        start = exc.pos
        while start and exc.doc[start - 1] in _NUMBER_CHARS:
            start -= 1
        return start < exc.pos and _PARTIAL_VALUE_TEXT.fullmatch(exc.doc, start) is not None
    return False


def _grammar_prefix(text: bytes) -> bool:
    """``_object_prefix`` token by token against JSON's grammar: no recursion (any depth),
    the open brackets a byte each."""
    open_, expect, pos, end = bytearray(b"{"), _KEY_OR_CLOSE, 1, len(text)
    while pos < end:
        if _partial_token(text, pos, expect):
            return True  # the text ends inside a token that more text completes
        token = _TOKEN.match(text, pos)
        if token is None:
            return False
        pos, kind = token.end(), text[token.start()]
        if kind in b" \t\r":
            continue
        if kind == b"["[0] and expect in _VALUE:  # a run of them at once (deep text)
            run = _OPEN_ARRAYS.match(text, pos)
            if run is not None:
                pos = run.end()
            open_.extend(b"[" * (1 + (run.group().count(b"[") if run else 0)))
            expect = _VALUE_OR_CLOSE
        elif kind == b"{"[0] and expect in _VALUE:
            open_.append(kind)
            expect = _KEY_OR_CLOSE
        elif kind == b'"'[0] and expect in _KEY:
            expect = _COLON
        elif kind not in b"{}[]:," and expect in _VALUE:  # a string, a number, a literal
            expect = _NEXT
        elif kind == b":"[0] and expect == _COLON:
            expect = _VALUE_ONLY
        elif kind == b","[0] and expect == _NEXT:
            expect = _KEY_ONLY if open_[-1] == b"{"[0] else _VALUE_ONLY
        elif kind in b"}]" and expect in _CLOSE and open_[-1] == _OPENER[kind]:
            open_.pop()
            if not open_:
                return False  # the object is whole (whatever follows it): a line
            expect = _NEXT
        else:
            return False
    return True


def _partial_token(text: bytes, pos: int, expect: int) -> bool:
    """Whether the text from ``pos`` to its end is a token begun, of a kind the grammar
    takes there: a string (a name or a value), or a number or a literal (a value)."""
    if text[pos] == b'"'[0]:
        return expect in _KEY + _VALUE and _PARTIAL_STRING.fullmatch(text, pos) is not None
    return expect in _VALUE and _PARTIAL_VALUE.fullmatch(text, pos) is not None


# what the grammar takes next: a value, or the bracket closing its array; a name, or the
# brace closing its object; a value (after a colon or a comma); a name (after a comma); the
# colon after a name; a comma or the closing bracket, after a value
_VALUE_OR_CLOSE, _KEY_OR_CLOSE, _VALUE_ONLY, _KEY_ONLY, _COLON, _NEXT = range(6)
_VALUE = (_VALUE_OR_CLOSE, _VALUE_ONLY)
_KEY = (_KEY_OR_CLOSE, _KEY_ONLY)
_CLOSE = (_VALUE_OR_CLOSE, _KEY_OR_CLOSE, _NEXT)
_OPENER = {b"}"[0]: b"{"[0], b"]"[0]: b"["[0]}
_OPEN_ARRAYS = re.compile(rb"(?:[ \t\r]*+\[)++")
_STRING_BODY = rb'(?:[^"\\\x00-\x1f]++|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*+'
# a whole token: white space, a string, a number, a literal, a bracket or a separator
_TOKEN = re.compile(
    rb"[ \t\r]++"
    rb'|"' + _STRING_BODY + rb'"'
    rb"|-?+(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?+(?:[eE][-+]?+[0-9]++)?+"
    rb"|true|false|null|[{}\[\]:,]"
)
# a token begun, that more text completes
_PARTIAL_STRING = re.compile(rb'"' + _STRING_BODY + rb"(?:\\(?:u[0-9a-fA-F]{0,3})?)?")
_PARTIAL_VALUE_PATTERN = (
    r"-|-?+(?:0|[1-9][0-9]*+)(?:\.[0-9]*+)?+(?:(?<=[0-9])[eE][-+]?+[0-9]*+)?+"
    r"|t(?:r(?:u)?)?|f(?:a(?:l(?:s)?)?)?|n(?:u(?:l)?)?"
)
_PARTIAL_VALUE = re.compile(_PARTIAL_VALUE_PATTERN.encode())
_PARTIAL_VALUE_TEXT = re.compile(_PARTIAL_VALUE_PATTERN)
# from the ``u`` of a ``\\u`` escape, where the decoder says it stopped
_PARTIAL_ESCAPE = re.compile(r"u[0-9a-fA-F]{0,4}(?:\\(?:u[0-9a-fA-F]{0,3})?)?")
_NUMBER_CHARS = frozenset("-+.eE0123456789")


def _whole_object(tail: bytes) -> bool:
    if not tail.rstrip().endswith(b"}"):  # most half-written lines, without reading them
        return False
    try:
        value = loads_exact(tail.decode("utf-8", "replace"))
    except ValueError:  # not JSON yet (too deep to read: it waits, as before)
        return False
    return isinstance(value, dict)


def first_lines(data: bytes, count: int) -> Iterator[tuple[int, bytes]]:
    """The first ``count`` complete lines of ``data`` as ``split_lines`` gives them, whatever
    their size, one at a time (the rest of the file is not split, nor copied)."""
    start = 0
    for number in range(1, count + 1):
        end = data.find(b"\n", start)
        if end < 0:
            return
        yield number, data[start:end]
        start = end + 1


def first_line(data: bytes) -> bytes:
    """The first line that is not blank (pi skips blank lines, a leading one too), complete
    or not (a header is recognised while still being written)."""
    start, body = 0, trimmed_end(data)
    while True:
        end = data.find(b"\n", start)
        line = data[start : body if end < 0 or end > body else end]  # the file's end trimmed
        line = _LEADING_JS_SPACE.sub(b"", line)  # as ``iter_objects`` reads the file's first line
        if end < 0 or line.strip():
            return line
        start = end + 1


def iter_objects(
    lines: Iterable[tuple[int, bytes]],
    *,
    path: Path | None = None,
    replaced: list[int] | None = None,
    ignored: list[IgnoredLine] | None = None,
) -> Iterator[tuple[int, Any]]:
    """Parsed lines; blank and malformed lines are skipped, as pi skips them, and each
    malformed one is appended to ``ignored`` (the import reports them by line).

    Invalid UTF-8 is read as pi reads it (Node's decoder): each maximal invalid subsequence
    becomes U+FFFD, Python's ``errors="replace"`` rule too. The numbers of the lines kept
    that way (their text is not the file's bytes) are appended to ``replaced``.

    A line nested too deeply to be read exactly is JSON pi would keep: it is refused with
    ``ImportFormatError`` naming its line, never skipped as malformed.

    What pi's ``content.trim()`` drops at the start of the file (JavaScript's whitespace,
    a byte order mark among it, over as many lines as it spans) is dropped; elsewhere, as
    for pi's ``JSON.parse``, a byte order mark makes its line malformed."""
    first = True
    for number, raw in lines:
        if first:
            raw = _LEADING_JS_SPACE.sub(b"", raw)
        if not raw.strip():
            continue
        first = False
        try:
            try:
                value = loads_exact(raw)
            except UnicodeDecodeError:
                value = loads_exact(raw.decode("utf-8", "replace"))
                if replaced is not None:
                    replaced.append(number)
        except NestedTooDeeply:
            where = f"{path} line {number}" if path is not None else f"line {number}"
            raise ImportFormatError(
                "/", f"{where}: nested too deeply to be read (over 1,000 levels)"
            ) from None
        except ValueError:
            log.debug(
                "skipping a line that is not JSON",
                extra={"path": str(path) if path is not None else None, "line": number},
            )
            if ignored is not None:
                ignored.append(IgnoredLine(number, NOT_JSON))
            continue
        yield number, value


def is_pi_header(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and value.get("type") == HEADER_TYPE
        and isinstance(value.get("id"), str)
    )


def sniff(data: bytes) -> bool:
    """Auto-detection: a pi (or oh-my-pi) file starts with a session header, whatever the
    size of that first line."""
    try:
        return is_pi_header(loads_exact(first_line(data)))
    except ValueError:
        return False


def parse(path: Path, data: bytes, *, literal_refs: bool = True) -> ParsedSession:
    """A pi session file's bytes as a ``ParsedSession`` of version-3 entries.

    ``literal_refs``: an image whose data reads as a blob ref is that text, kept escaped
    (``holds_ref_image``); oh-my-pi's parser, whose files hold refs to their blobs
    directory, resolves them first (``core.interop.omp``)."""
    lines, consumed, incomplete = split_lines(data)
    replaced: list[int] = []
    ignored: list[IgnoredLine] = []
    objects = list(iter_objects(lines, path=path, replaced=replaced, ignored=ignored))
    if not objects or not is_pi_header(objects[0][1]):
        raise ImportFormatError(str(path), "the first line is not a pi session header")
    values = [value for _, value in objects]
    header = values[0]
    version = source_version(header, path=path)
    # A migration copies values between lines (version 1's compaction takes its kept
    # entry's id, any JSON value): a line's own bytes then no longer rule it out, the
    # whole file's do.
    migrated = migrate(values)
    whole = {
        claude_code: escape_test([data], refs=literal_refs, transient_keys=claude_code)
        for claude_code in ((False, True) if migrated else ())
    }
    raw_of = dict(lines)
    entries = []
    for number, value in objects[1:]:
        why = entry_problem(value)
        if why is not None:
            ignored.append(IgnoredLine(number, why))
            continue
        # pi drops its transient keys; a line exported from a Claude Code import keeps them
        claude_code = CLAUDE_CODE_KEY in value
        escape = (
            whole[claude_code]
            if migrated
            else escape_test([raw_of[number]], refs=literal_refs, transient_keys=claude_code)
        )
        if escape is not None and escape(value):
            entries.append(ParsedEntry(number, escaped_line(value, literal_refs=literal_refs)))
        elif not is_event_type(value.get("type")):
            entries.append(ParsedEntry(number, {"type": UNTYPED_LINE, "line": value}))
        else:
            entries.append(ParsedEntry(number, value))
    return ParsedSession(
        format="pi",
        header=dataclasses.replace(header_of(header, version=version), title=session_name(values)),
        entries=entries,
        incomplete_tail=incomplete,
        consumed_bytes=consumed,
        invalid_utf8_lines=invalid_utf8(path, replaced),
        ignored_lines=ignored_lines(path, ignored),
    )


def session_name(values: Sequence[Any]) -> str | None:
    """The session's name as pi's ``getSessionName`` reads it: the latest ``session_info``
    entry's ``name``, trimmed; "" when that entry clears it (an empty name), None when no
    entry names one (or the latest holds a name that is no text, which pi cannot trim)."""
    for value in reversed(values[1:]):
        if isinstance(value, dict) and value.get("type") == SESSION_INFO:
            name = info_name(value)
            # one no session row can hold (U+0000) leaves the title as it is, the file
            # imported all the same
            return None if name is not None and "\0" in name else name
    return None


def info_name(entry: Mapping[str, Any]) -> str | None:
    """A ``session_info`` entry's name as pi reads it (``name?.trim() || undefined``):
    trimmed; "" when it clears the session's (empty, missing, null); None for a name pi
    cannot trim (a number, an object: pi throws)."""
    name = entry.get("name")
    if name is None:
        return ""
    return name.strip(_JS_SPACE) if isinstance(name, str) else None


SESSION_INFO = "session_info"


def entry_problem(value: Any) -> str | None:
    """Why a parsed line is no entry (pi's session tree has no place for a value that is not
    an object), or None."""
    if not isinstance(value, dict):
        return NOT_AN_OBJECT
    return None


def is_event_type(value: Any) -> bool:
    """Whether the journal holds ``value`` as an event's type (pi keeps any ``type``)."""
    return isinstance(value, str) and 0 < len(value) <= MAX_TYPE_LENGTH and "\x00" not in value


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def holds_surrogate_escape(raw: bytes) -> bool:
    """Whether a line's bytes may hold a lone surrogate: only an escape can (invalid UTF-8
    is read as U+FFFD), and an escape of one half of a pair is one."""
    return b"\\u" in raw and _SURROGATE_ESCAPE.search(raw) is not None


def holds_lone_surrogate(value: Any) -> bool:
    """Whether a decoded value holds a lone surrogate, in a string or a key."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if LONE_SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def holds_ref_image(value: Any) -> bool:
    """Whether a line holds an image block whose ``data`` reads as a blob ref
    (``blob:sha256:<hex>``): the journal takes that for a ref to a stored blob (a producer
    sends one for an image it stored before), while in a file another agent wrote it is the
    text it is, which would otherwise name (or fail on) a blob of the store. Only a line
    whose bytes ``may_hold_ref`` can."""
    return _any_object(value, _is_ref_image)


def may_hold_ref(raw: bytes) -> bool:
    """Whether a line's bytes may spell a blob ref: as written, or with ``\\u`` escapes."""
    return BLOB_REF_PREFIX.encode() in raw or _may_escape_ascii(raw)


# A name or prefix of printable ASCII spelled with escapes escapes one of its characters
# (U+0020..U+007F); the escapes common in files (\u001b of terminal colours, \u2028) do not.
_ASCII_ESCAPE = re.compile(rb"\\u00[2-7][0-9a-fA-F]")


def _may_escape_ascii(raw: bytes) -> bool:
    return b"\\u" in raw and _ASCII_ESCAPE.search(raw) is not None


# The member of an entry imported from a Claude Code transcript that keeps its line
# (``core.interop.claude_code``): exported as a pi line and read again, the line's keys
# the journal drops as pi's transient state are kept, as its import kept them.
CLAUDE_CODE_KEY = "claudeCode"


def holds_transient_key(value: Any) -> bool:
    """Whether a line holds a key the journal drops as pi's transient state
    (``TRANSIENT_FIELDS``): in another agent's file, data like any other. Only a line whose
    bytes ``may_hold_transient_key`` can."""
    return _any_object(value, lambda item: not TRANSIENT_FIELDS.isdisjoint(item))


def may_hold_transient_key(raw: bytes) -> bool:
    """Whether a line's bytes may spell such a key: as written, or with ``\\u`` escapes."""
    return _may_escape_ascii(raw) or any(marker in raw for marker in _TRANSIENT_MARKERS)


_TRANSIENT_MARKERS = tuple(f'"{name}"'.encode() for name in sorted(TRANSIENT_FIELDS))


def escape_test(
    raws: Iterable[bytes], *, refs: bool = True, transient_keys: bool = True
) -> Callable[[Any], bool] | None:
    """Whether a line parsed from ``raws`` must be kept escaped (``escaped_line``), as a
    test of its value, or None where the bytes rule every reason out (the common case). The
    reasons: a lone surrogate (only an escape writes one: invalid UTF-8 is read as U+FFFD),
    an image whose data reads as a blob ref (``refs``), a key the journal drops as pi's
    transient state (``transient_keys``)."""
    raws = list(raws)
    tests = [
        holds
        for wanted, may_hold, holds in (
            (True, holds_surrogate_escape, holds_lone_surrogate),
            (refs, may_hold_ref, holds_ref_image),
            (transient_keys, may_hold_transient_key, holds_transient_key),
        )
        if wanted and any(may_hold(raw) for raw in raws)
    ]
    if not tests:
        return None
    return lambda value: any(test(value) for test in tests)


def _is_ref_image(item: dict[str, Any]) -> bool:
    data = item.get("data")
    return item.get("type") == "image" and isinstance(data, str) and looks_like_ref(data)


def _any_object(value: Any, test: Callable[[dict[str, Any]], bool]) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if test(item):
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def escaped_line(value: dict[str, Any], *, literal_refs: bool = True) -> dict[str, Any]:
    """The event that keeps a line the journal cannot hold as it is (``ESCAPED_LINE``: a
    lone surrogate, an image's data reading as a blob ref, a key it drops): the line
    escaped (``value``), or its text (``json``) if the escape would nest too deeply."""
    event: dict[str, Any] = {"type": ESCAPED_LINE}
    for key in ("id", "parentId"):
        if key in value and not holds_lone_surrogate(value[key]):
            event[key] = value[key]
    if _depth(value, ESCAPED_MAX_DEPTH) < ESCAPED_MAX_DEPTH:
        escaped = _escaped(value, literal_refs)
        if _depth(escaped, ESCAPED_MAX_DEPTH) < ESCAPED_MAX_DEPTH:
            event["value"] = escaped
            return event
    event["json"] = dumps_exact(value)
    return event


def _depth(value: Any, most: int) -> int:
    """How many levels of objects and arrays ``value`` nests (``most`` once it reaches it)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            if level >= most:
                return most
            deepest = max(deepest, level)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return deepest


def _escaped(value: Any, literal_refs: bool) -> Any:
    """``value`` with its strings holding a lone surrogate and its objects with a key that
    cannot be stored escaped (``ESCAPED_STRING``, ``ESCAPED_OBJECT``)."""
    if isinstance(value, str):
        return _escaped_string(value) if LONE_SURROGATE.search(value) else value
    if isinstance(value, list):
        return [_escaped(item, literal_refs) for item in value]
    if isinstance(value, dict):
        if any(_escaped_key(key) for key in value) or (literal_refs and _is_ref_image(value)):
            return {
                ESCAPED_OBJECT: [
                    _escaped(x, literal_refs) for member in value.items() for x in member
                ]
            }
        return {key: _escaped(item, literal_refs) for key, item in value.items()}
    return value


def escaped_refs(value: Any) -> Any:
    """An escaped line's ``value`` (``_escaped`` with ``literal_refs`` off) with its images
    whose data reads as a blob ref escaped as well, and nothing else changed."""
    if isinstance(value, list):
        return [escaped_refs(item) for item in value]
    if isinstance(value, dict):
        if _is_ref_image(value):  # its keys are plain: one that is not made it escaped
            return {ESCAPED_OBJECT: [x for k, v in value.items() for x in (k, escaped_refs(v))]}
        return {key: escaped_refs(item) for key, item in value.items()}
    return value


def _escaped_key(key: str) -> bool:
    return key in _ESCAPED_KEYS or "\x00" in key or LONE_SURROGATE.search(key) is not None


def _escaped_string(text: str) -> dict[str, list[str | int]]:
    pieces: list[str | int] = []
    start = 0
    for match in LONE_SURROGATE.finditer(text):
        if match.start() > start:
            pieces.append(text[start : match.start()])
        pieces.append(ord(match[0]))
        start = match.end()
    if start < len(text):
        pieces.append(text[start:])
    return {ESCAPED_STRING: pieces}


def unescaped(value: Any, load: Callable[[Any], Any] | None = None) -> Any:
    """The line an escaped line's ``value`` holds (``_escaped`` undone). ``load``: what a
    piece of a string, or a key, is read with (a lazy blob's value); an escape that is not
    well formed (not written by the import) is read as the object it is."""
    if isinstance(value, list):
        return [unescaped(item, load) for item in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        [(key, inner)] = value.items()
        if key == ESCAPED_STRING:
            text = _joined(inner, load)
            if text is not None:
                return text
        elif key == ESCAPED_OBJECT:
            members = _members(inner, load)
            if members is not None:
                return members
    return {key: unescaped(item, load) for key, item in value.items()}


def _joined(pieces: Any, load: Callable[[Any], Any] | None) -> str | None:
    if not isinstance(pieces, list):
        return None
    parts = []
    for piece in pieces:
        if load is not None:
            piece = load(piece)
        if isinstance(piece, str):
            parts.append(piece)
        elif type(piece) is int and 0xD800 <= piece <= 0xDFFF:
            parts.append(chr(piece))
        else:
            return None
    return "".join(parts)


def _members(items: Any, load: Callable[[Any], Any] | None) -> dict[str, Any] | None:
    if not isinstance(items, list) or len(items) % 2:
        return None
    keys = [unescaped(key, load) for key in items[::2]]
    if load is not None:
        keys = [load(key) for key in keys]
    if not all(isinstance(key, str) for key in keys):
        return None
    return {key: unescaped(item, load) for key, item in zip(keys, items[1::2], strict=True)}


def escaped_value(
    payload: Mapping[str, Any], load: Callable[[Any], Any] | None = None
) -> dict[str, Any] | None:
    """The line an ``ESCAPED_LINE`` event keeps (``load``: as ``unescaped``, and how its
    ``json`` is read): None unless that is an object (its ``json`` a blob's ref, or an
    event not written by the import)."""
    if "value" in payload:
        try:
            value = unescaped(payload["value"], load)
        except RecursionError:
            return None
        return value if isinstance(value, dict) else None
    text = payload.get("json")
    if load is not None:
        text = load(text)
    if not isinstance(text, str):
        return None
    try:
        value = loads_exact(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def line_value(entry: Mapping[str, Any]) -> Any:
    """The value of an entry's line in a pi file (what ``line_text`` writes)."""
    kind = entry.get("type")
    if kind == UNTYPED_LINE and isinstance(entry.get("line"), dict):
        return entry["line"]
    if kind == ESCAPED_LINE:
        line = escaped_value(entry)
        if line is not None:
            return line
    return entry  # not written by the import: the event as it is


def stored_header(kind: str, payload: Any) -> dict[str, Any] | None:
    """The header a session's first event holds (export writes it first, and pi's
    ``getHeader`` takes it): a ``session`` event, or the ``ESCAPED_LINE`` that keeps a
    header holding a lone surrogate; None for anything else."""
    if kind == HEADER_TYPE and isinstance(payload, dict):
        return payload
    if kind == ESCAPED_LINE and isinstance(payload, dict):
        value = escaped_value(payload)
        if value is not None and value.get("type") == HEADER_TYPE:
            return value
    return None


def line_text(entry: Mapping[str, Any]) -> str:
    """An entry's line in a pi file: the line an event of ``UNTYPED_LINE`` or
    ``ESCAPED_LINE`` keeps, as it was read."""
    kind = entry.get("type")
    if kind == ESCAPED_LINE and "value" not in entry and isinstance(entry.get("json"), str):
        return str(entry["json"])
    return dumps_exact(dict(line_value(entry)))


def ignored_lines(path: Path, ignored: list[IgnoredLine]) -> list[IgnoredLine]:
    """The lines that hold no entry, in file order (logged at info level, with the first:
    the import's result lists them, and the CLI says them)."""
    ignored.sort(key=lambda skipped: skipped.line)
    if ignored:
        log.info(
            "%r: lines that hold no session entry were not imported",
            str(path),
            extra={"path": str(path), "lines": len(ignored), "first_line": ignored[0].line},
        )
    return ignored


def invalid_utf8(path: Path, replaced: list[int]) -> int:
    """How many lines were read with U+FFFD for invalid UTF-8 (logged at info level, with
    the first: the import's result counts them, and the CLI says so)."""
    if replaced:
        log.info(
            "%r: lines with invalid UTF-8 were read with U+FFFD in place of the bad bytes, as "
            "pi reads them",
            str(path),
            extra={"path": str(path), "lines": len(replaced), "first_line": replaced[0]},
        )
    return len(replaced)


def header_of(raw: Mapping[str, Any], *, version: int) -> SessionHeader:
    def text(key: str) -> str | None:
        value = raw.get(key)
        return value if isinstance(value, str) else None

    return SessionHeader(
        external_id=str(raw["id"]),
        version=version,
        cwd=text("cwd"),
        timestamp=text("timestamp"),
        parent_session=text("parentSession"),
        raw=dict(raw),
    )


# pi's migrations ---------------------------------------------------------------------------


def migrate(values: list[Any]) -> bool:
    """Bring a parsed file (header first) to version 3 in place; True if anything changed."""
    header = next((v for v in values if isinstance(v, dict) and v.get("type") == "session"), None)
    version = js_version(header)
    # pi's ``(version ?? 1) >= 3``, ``< 2`` and ``< 3``: NaN (``"abc"``, ``{}``) is none of them
    if version >= CURRENT_VERSION or math.isnan(version):
        return False
    if version < 2:
        _v1_to_v2(values, str(header.get("id")) if header else "")
    if version < 3:
        _v2_to_v3(values)
    return True


def source_version(header: Mapping[str, Any], *, path: Path) -> int:
    """The version pi migrates the file from: 1, 2 or 3 (3: pi migrates nothing)."""
    try:
        version = js_version(header)
    except TypeError:
        raise ImportFormatError(
            str(path), "pi cannot open this file: its header's version is not comparable"
        ) from None
    return 1 if version < 2 else 2 if version < 3 else 3


def js_version(header: Mapping[str, Any] | None) -> float:
    """``header?.version ?? 1`` as the number JavaScript compares with 3 (``"3"``, ``3.0``
    and ``[3]`` are 3; ``true`` is 1; ``{}`` is NaN). TypeError where JavaScript throws."""
    value = header.get("version") if header is not None else None
    return 1.0 if value is None else _js_to_number(value)


# JavaScript's StringToNumber: optional white space around a decimal literal (a sign,
# Infinity, an exponent; no separators) or an unsigned 0x / 0o / 0b integer; empty is 0
_JS_SPACE = (
    "\t\n\v\f\r \u00a0\u1680"
    + "".join(map(chr, range(0x2000, 0x200B)))
    + "\u2028\u2029\u202f\u205f\u3000\ufeff"
)
# the same at the start of a line's bytes (UTF-8): what ``content.trim()`` drops there
_LEADING_JS_SPACE = re.compile(
    rb"\A(?:" + b"|".join(re.escape(c.encode()) for c in _JS_SPACE) + rb")+"
)
_JS_SPACE_BYTES = tuple(c.encode() for c in _JS_SPACE)
_JS_DECIMAL = re.compile(r"[+-]?(?:Infinity|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)")
_JS_RADIX = {"x": 16, "X": 16, "o": 8, "O": 8, "b": 2, "B": 2}
_JS_INTEGER = re.compile(r"0([xX][0-9a-fA-F]+|[oO][0-7]+|[bB][01]+)")


def _js_to_number(value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:  # JSON.parse reads an integer beyond a double as ±Infinity
            return math.inf if value > 0 else -math.inf
    text = value if isinstance(value, str) else _js_to_string(value)
    text = text.strip(_JS_SPACE)
    if not text:
        return 0.0
    if _JS_DECIMAL.fullmatch(text):
        return float(text.replace("Infinity", "inf"))
    radix = _JS_INTEGER.fullmatch(text)
    if radix:
        try:
            return float(int(radix.group(1)[1:], _JS_RADIX[radix.group(1)[0]]))
        except OverflowError:  # beyond a double: JavaScript's Number() is Infinity
            return math.inf
    return math.nan


_END = object()


def _js_to_string(value: Any) -> str:
    """``String(value)`` for a JSON value, as far as a number can be read back from it.
    Arrays are joined without recursion (JavaScript joins an array nested far deeper than
    Python's recursion limit)."""
    if not isinstance(value, list):
        return _js_scalar_string(value)
    parts: list[str] = []
    open_arrays: list[Iterator[Any]] = [iter(value)]
    first = [True]
    while open_arrays:
        item = next(open_arrays[-1], _END)
        if item is _END:
            open_arrays.pop()
            first.pop()
            continue
        if not first[-1]:
            parts.append(",")
        first[-1] = False
        if isinstance(item, list):
            open_arrays.append(iter(item))
            first.append(True)
        elif item is not None:  # Array.prototype.join: null is ""
            parts.append(_js_scalar_string(item))
    return "".join(parts)


def _js_scalar_string(value: Any) -> str:
    if isinstance(value, dict):
        if "toString" in value:  # an own, non-callable toString: ToPrimitive throws
            raise TypeError("Cannot convert object to primitive value")
        return "[object Object]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return str(value)  # a number reads back as itself (the only use of this text)


def v1_entry_id(session_id: str, index: int, taken: set[str]) -> str:
    """A deterministic 8-hex id for the ``index``-th parsed line of a v1 file."""
    digest = v1_digest(session_id, index)
    for start in range(0, len(digest) - 8):
        candidate = digest[start : start + 8]
        if candidate not in taken:
            return candidate
    return digest  # 56 collisions in a row cannot happen among a file's ids


def v1_digest(session_id: str, index: int) -> str:
    """What a v1 entry's id is drawn from (a header id may hold a lone surrogate)."""
    return hashlib.sha256(f"{session_id}\0{index}".encode("utf-8", "surrogatepass")).hexdigest()


def _v1_to_v2(values: list[Any], session_id: str) -> None:
    taken: set[str] = set()
    previous: str | None = None
    for index, entry in enumerate(values):
        if not isinstance(entry, dict):
            continue
        if entry.get("type") == "session":
            entry["version"] = 2
            continue
        entry_id = v1_entry_id(session_id, index, taken)
        taken.add(entry_id)
        entry["id"] = entry_id
        entry["parentId"] = previous
        previous = entry_id
        if entry.get("type") == "compaction" and "firstKeptEntryIndex" in entry:
            kept = entry["firstKeptEntryIndex"]
            if isinstance(kept, (int, float)) and not isinstance(kept, bool):
                # ``entries[index]``: only a whole index in range finds a line (1e999 reads
                # as Infinity, which finds none)
                whole = 0 <= kept < len(values) and kept == int(kept)
                target = values[int(kept)] if whole else None
                # pi assigns ``target.id``: a later line has no id yet, and the key, set to
                # undefined, is not written (its own ``id``, if the v1 line has one, is)
                if isinstance(target, dict) and target.get("type") != "session":
                    if "id" in target:
                        entry["firstKeptEntryId"] = target["id"]
                del entry["firstKeptEntryIndex"]


def _v2_to_v3(values: list[Any]) -> None:
    for entry in values:
        if not isinstance(entry, dict):
            continue
        if entry.get("type") == "session":
            entry["version"] = 3
            continue
        message = entry.get("message")
        if (
            entry.get("type") == "message"
            and isinstance(message, dict)
            and message.get("role") == "hookMessage"
        ):
            message["role"] = "custom"


# writing -------------------------------------------------------------------------------


def is_header(raw: dict[str, Any]) -> bool:
    """Whether a parsed header's ``raw`` is a pi header line (else fields to build one from)."""
    return raw.get("type") == HEADER_TYPE and isinstance(raw.get("id"), str)


def header_event(header: SessionHeader) -> dict[str, Any]:
    """The header as it is kept in the journal (the event at seq 1 of an imported session):
    the migrated original when there is one, else a version-3 header built from the fields;
    one holding a lone surrogate (pi reads it) as the ``ESCAPED_LINE`` that keeps it."""
    if is_header(header.raw):
        event = dict(header.raw)
    else:
        event = new_header(header.external_id, timestamp=header.timestamp, cwd=header.cwd)
    return escaped_line(event) if holds_lone_surrogate(event) else event


def new_header(
    session_id: str,
    *,
    timestamp: str | None,
    cwd: str | None,
    parent_session: str | None = None,
) -> dict[str, Any]:
    """A version-3 header, with pi's key order."""
    header: dict[str, Any] = {
        "type": HEADER_TYPE,
        "version": CURRENT_VERSION,
        "id": session_id,
        "timestamp": timestamp,
        "cwd": cwd or "",
    }
    if parent_session is not None:
        header["parentSession"] = parent_session
    return header


def write(out: IO[str], header: Mapping[str, Any], entries: Iterable[Mapping[str, Any]]) -> int:
    """Write a version-3 file: the header, then one entry per line. Returns the line count."""
    out.write(dumps_exact(dict(header)) + "\n")
    count = 1
    for entry in entries:
        out.write(line_text(entry) + "\n")
        count += 1
    return count


# pi's context messages -------------------------------------------------------------------


def js_time(value: Any) -> int | None:
    """``new Date(value).getTime()`` for the ISO timestamps pi writes (None for NaN)."""
    if not isinstance(value, str):
        return None
    try:
        stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    try:
        if stamp.tzinfo is None:  # JavaScript reads a date-time without offset as local time
            stamp = stamp.astimezone()
        return round(stamp.timestamp() * 1000)
    except (OverflowError, ValueError, OSError):
        # the platform's local-time conversion ends before year 2 or after 9998 (JavaScript's
        # does not): such a stamp is read as UTC
        return round(stamp.replace(tzinfo=UTC).timestamp() * 1000)


# role and entry type -> the entry fields pi's ``createCustomMessage`` /
# ``createBranchSummaryMessage`` / ``createCompactionSummaryMessage`` copy, in their order
_MADE_MESSAGES: dict[tuple[str, Any], tuple[str, ...]] = {
    ("custom", "custom_message"): ("customType", "content", "display", "details"),
    ("branchSummary", "branch_summary"): ("summary", "fromId"),
    ("compactionSummary", "compaction"): ("summary", "tokensBefore"),
}


def agent_message(role: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """One message of pi's context (an ``AgentMessage``) from a state message's data: the
    message object itself, or the message pi makes of a custom message, branch summary or
    compaction entry (a field the entry lacks is left out, as JSON.stringify drops
    ``undefined``)."""
    fields = _MADE_MESSAGES.get((role, data.get("type")))
    if fields is None:
        return dict(data)
    made: dict[str, Any] = {"role": role}
    made.update((name, data[name]) for name in fields if name in data)
    made["timestamp"] = js_time(data.get("timestamp"))
    return made
