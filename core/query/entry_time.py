"""An event's entry time: the payload's own ``timestamp`` (``events --since/--until``; the
time-block summary's second bound), as whole epoch microseconds in SQL.

What counts as an entry time, the same on every backend (``tests/contract/test_entry_time.py``
runs one table of cases and a property on each):

- A JSON number is epoch milliseconds. An integer exactly; any other number as a double
  (what JSON readers make of it), times 1000 in double precision, floored to a whole
  microsecond. A non-integer literal over 40 characters, or with an exponent of 4 digits or
  more, is not one: the journal writes floats as their shortest round-trip text, never such
  a literal, and PostgreSQL could not read all of them.
- A JSON string is an ISO 8601 / RFC 3339 date-time: ``YYYY-MM-DD``, ``T`` or a space,
  ``hh:mm``, optionally ``:ss`` and then optionally a fraction (``.`` and any number of
  digits, read to the microsecond, the rest dropped), then optionally a zone: ``Z``,
  ``±hh:mm``, ``±hhmm`` or ``±hh`` (up to 23:59); without one, UTC. Each field in its range:
  a real day of the (proleptic Gregorian) calendar, years 0001-9999, hours 00-23, minutes
  and seconds 00-59 (no leap second, no 24:00). ``T`` and ``Z`` in upper case, nothing
  before or after: a date alone, week dates, basic format (``20250101T...``) and names of
  zones are not entry times.
- The instant lies in the years 0001-9999 UTC, what a bound (a ``datetime``, whole
  microseconds too) can name: ``MIN_US`` to ``MAX_US``.

Anything else (``true``, an object, ``"NaN"``, ``10**309``, a megabyte of text) has no entry
time: it matches no entry bound, and it never makes a query fail (DESIGN invariant 11).

The text's form and each field's range are checked by this project, not by a date function
of either backend (their rules differ: SQLite's julianday rolls 2025-02-30 over to March,
takes 24:30 and no +0530; PostgreSQL's timestamptz takes neither a zone past 15:59 nor long
fractions). Each backend has a function of its own for it, called by one name in queries:
on PostgreSQL ``sessionstore_entry_us(payload)``, PL/pgSQL created by migration 0019 (a
regular expression for the form, the fields read by their places and checked, make_date
for the day); on SQLite ``core.entry_clock.entry_us_of``, a Python function registered on
each connection (SQLite has no regular expressions: the same checks in its SQL took ~7 us
a row, the function about one). Inline SQL on PostgreSQL was 32 KB per query that used it.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Date,
    Engine,
    Integer,
    Numeric,
    case,
    cast,
    func,
    literal,
)
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import Function

from core.db import is_sqlite
from core.entry_clock import POSTGRES_FUNCTION, SQLITE_FUNCTION
from core.models import EventRow, table_of

_events = table_of(EventRow)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US_PER_DAY = 86_400_000_000


def bound_us(when: datetime) -> int:
    """``when`` in epoch microseconds, exactly (a float of ``when.timestamp()`` is not); a
    naive ``when`` is local time, as ``timestamp()`` takes it. An offset may take it past
    the range of entry times: then it is before or after all of them."""
    aware = when if when.tzinfo is not None else when.astimezone()
    return (aware - _EPOCH) // timedelta(microseconds=1)  # no overflow at the range's ends


def entry_us(engine: Engine) -> ColumnElement[Any]:
    """The payload's entry time (see the module) in whole epoch microseconds, a BIGINT; NULL
    when it has none. For a query over ``events``: it reads the row's payload."""
    return _sqlite_entry_us() if is_sqlite(engine) else _postgres_entry_us()


def _sqlite_entry_us() -> ColumnElement[Any]:
    """``core.entry_clock.entry_us_of``, registered on every SQLite connection."""
    path = "$.timestamp"
    return Function(
        SQLITE_FUNCTION,
        func.json_type(_events.c.payload, path),
        func.json_extract(_events.c.payload, path),
        _events.c.payload.op("->")(path),  # a number's literal, as written (reals only)
        type_=BigInteger,
    )


def _postgres_entry_us() -> ColumnElement[Any]:
    """The PL/pgSQL function migration 0019 creates, of the row's payload."""
    return Function(POSTGRES_FUNCTION, _events.c.payload, type_=BigInteger)


def entry_day(engine: Engine, fallback: ColumnElement[Any]) -> ColumnElement[Any]:
    """The day (``YYYY-MM-DD``) of the entry's own time, for an entry that has one (``entry_us``,
    the module's one definition), else ``fallback`` (the day the journal recorded it).

    An ISO text gives the day as written: its first ten characters, the producer's local day
    for ``…-05:00`` (what a person means by "spent on the 1st"). An epoch-millisecond number,
    which has no zone, gives its UTC day (the floor of the microseconds over a day's, exactly,
    before 1970 too). A ``timestamp`` that is no entry time (``"yesterday"``, ``"2025-01-01"``
    alone, ``"2025-02-30T…"``, ``true``) gives no day of its own."""
    us = entry_us(engine)
    if is_sqlite(engine):
        is_text = func.json_type(_events.c.payload, "$.timestamp") == "text"
        stamp = func.json_extract(_events.c.payload, "$.timestamp")
        # whole seconds, floored: integer division in SQLite truncates toward zero
        seconds = us // 1_000_000 - case((us % 1_000_000 < 0, 1), else_=0)
        utc_day = func.date(seconds, "unixepoch")
    else:
        # events.payload is json (exact text), not jsonb: the json_* functions
        is_text = func.json_typeof(func.json_extract_path(_events.c.payload, "timestamp")) == (
            "string"
        )
        stamp = func.json_extract_path_text(_events.c.payload, "timestamp")
        days = func.floor(cast(us, Numeric) / _US_PER_DAY)
        utc_day = func.to_char(literal(date(1970, 1, 1), Date) + cast(days, Integer), "YYYY-MM-DD")
    own = case((is_text, case((us.is_not(None), func.substr(stamp, 1, 10)))), else_=utc_day)
    return func.coalesce(own, fallback)
