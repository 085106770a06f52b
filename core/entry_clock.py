"""The entry-time definition (``core.query.entry_time``) as a Python function, for SQLite.

SQLite has no regular expressions and its date functions take other forms than the
definition's, so checking the form and every field's range in its SQL took ~7 us a row
(substr, GLOB and CASE over the text, many times each); this function, registered on every
SQLite connection (``core.db``), takes about one. PostgreSQL computes the same in SQL. The
two are held to one table of cases and a property (``tests/contract/test_entry_time.py``).
Standard library only: ``core.db`` imports it.
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta
from typing import Any

MIN_US = -62_135_596_800_000_000  # 0001-01-01T00:00:00.000000Z
MAX_US = 253_402_300_799_999_999  # 9999-12-31T23:59:59.999999Z
MIN_MS, MAX_MS = MIN_US // 1000, MAX_US // 1000  # the integers (epoch ms) within them
SQLITE_FUNCTION = "sessionstore_entry_us"
# PostgreSQL's own reading, in PL/pgSQL: created by migration 0019, which names it too
POSTGRES_FUNCTION = "sessionstore_entry_us"

_ISO = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[T ]([0-9]{2}):([0-9]{2})"
    r"(?::([0-9]{2})(?:\.([0-9]+))?)?(Z|[+-][0-9]{2}(?::?[0-9]{2})?)?"
)
_LONG_EXPONENT = re.compile(r"[eE][+-]?[0-9]{4}")
_EPOCH = datetime(1970, 1, 1)
_US = timedelta(microseconds=1)


def entry_us_of(kind: Any, value: Any, literal: Any) -> int | None:
    """The entry time in epoch microseconds of a ``timestamp`` SQLite reads as ``kind``
    (``json_type``), ``value`` (``json_extract``) and ``literal`` (its JSON text); None
    when it has none. Never raises: stored data never makes a query fail."""
    try:
        if kind == "integer":
            return int(value) * 1000 if MIN_MS <= value <= MAX_MS else None
        if kind == "real":
            return _real(float(value), literal)
        if kind == "text" and isinstance(value, str):
            return _text(value)
    except (TypeError, ValueError, OverflowError):
        pass
    return None


def _real(value: float, literal: Any) -> int | None:
    # the journal writes a float as its shortest text: a longer literal, or one with a
    # 4-digit exponent, is no timestamp it wrote (nor one PostgreSQL reads alike)
    if not isinstance(literal, str) or len(literal) > 40 or _LONG_EXPONENT.search(literal):
        return None
    micros = value * 1000.0
    return math.floor(micros) if MIN_US <= micros < MAX_US + 1 else None


def _text(text: str) -> int | None:
    match = _ISO.fullmatch(text)
    if match is None:
        return None
    year, month, day, hour, minute, second, fraction, zone = match.groups()
    try:
        naive = datetime(int(year), int(month), int(day), int(hour), int(minute), int(second or 0))
    except ValueError:  # no such day, hour 24, minute or second 60, year 0000
        return None
    micros = (naive - _EPOCH) // _US + int((fraction or "0")[:6].ljust(6, "0"))
    if zone and zone != "Z":
        digits = zone[1:].replace(":", "")
        hours, minutes = int(digits[:2]), int(digits[2:] or 0)
        if hours > 23 or minutes > 59:
            return None
        micros -= (1 if zone[0] == "+" else -1) * (hours * 60 + minutes) * 60_000_000
    return micros if MIN_US <= micros <= MAX_US else None
