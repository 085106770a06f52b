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
fractions). On PostgreSQL in SQL: a regular expression for the form, then the fields read
by their places, checked, and one piece of integer arithmetic (make_date numbers the day).
On SQLite, which has no regular expressions, by ``core.entry_clock.entry_us_of``, a Python
function registered on each connection: the same checks in SQL (substr, GLOB, CASE) took
~7 us a row there, the function about one.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from functools import cache
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    Date,
    Engine,
    Float,
    Integer,
    Numeric,
    and_,
    case,
    cast,
    func,
    literal,
    literal_column,
    or_,
    select,
)
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import Function

from core.db import is_sqlite
from core.entry_clock import MAX_MS, MAX_US, MIN_MS, MIN_US, SQLITE_FUNCTION
from core.models import EventRow, table_of

_events = table_of(EventRow)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US_PER_DAY, _US_PER_HOUR, _US_PER_MINUTE = 86_400_000_000, 3_600_000_000, 60_000_000
# a negative number nearer 0 than this (2**-1075) is -0.0 as a double; further, -1 floored
_NEGATIVE_ZERO = Decimal("-2.4703282292062328e-324")
_TINY, _HUGE = Decimal("1e-300"), Decimal("1e300")  # within these a double holds a numeric


def bound_us(when: datetime) -> int:
    """``when`` in epoch microseconds, exactly (a float of ``when.timestamp()`` is not); a
    naive ``when`` is local time, as ``timestamp()`` takes it. An offset may take it past
    the range of entry times: then it is before or after all of them."""
    aware = when if when.tzinfo is not None else when.astimezone()
    return (aware - _EPOCH) // timedelta(microseconds=1)  # no overflow at the range's ends


def entry_us(engine: Engine) -> ColumnElement[Any]:
    """The payload's entry time (see the module) in whole epoch microseconds, a BIGINT; NULL
    when it has none. For a query over ``events``: it reads the row's payload."""
    return _entry_us(is_sqlite(engine))


@cache
def _entry_us(sqlite: bool) -> ColumnElement[Any]:
    """Built once per backend and reused by every query (SQLAlchemy expressions are
    immutable): PostgreSQL's is a large expression, and building it anew for each query
    cost more than running it (``stats()`` built it for each part it reads)."""
    return _sqlite_entry_us() if sqlite else _postgres_entry_us()


class _Fields(NamedTuple):
    """An ISO text's fields as BIGINT expressions; NULL unless the text has the form of the
    definition (the fields' ranges are not checked yet)."""

    year: ColumnElement[Any]
    month: ColumnElement[Any]
    day: ColumnElement[Any]
    hour: ColumnElement[Any]
    minute: ColumnElement[Any]
    second: ColumnElement[Any]
    micro: ColumnElement[Any]
    zone_sign: ColumnElement[Any]
    zone_hours: ColumnElement[Any]
    zone_minutes: ColumnElement[Any]


def _unchecked_us(f: _Fields) -> ColumnElement[Any]:
    """Epoch microseconds of the text ``f`` was read from, NULL unless it has the form and
    its fields their ranges; the instant's range is the caller's to check (at one place, as
    each use of this expression evaluates it again). The day is numbered (``make_date``)
    only for a valid date."""
    leap = and_(f.year % 4 == 0, or_(f.year % 100 != 0, f.year % 400 == 0))
    month_days = case(
        (f.month == 2, case((leap, 29), else_=28)),
        (f.month.in_([4, 6, 9, 11]), 30),
        else_=31,
    )
    valid = and_(
        f.year >= 1,
        f.month.between(1, 12),
        f.day.between(1, month_days),
        f.hour <= 23,
        f.minute <= 59,
        f.second <= 59,
        f.zone_hours <= 23,
        f.zone_minutes <= 59,
    )
    us = (
        _postgres_days(f) * _US_PER_DAY
        + f.hour * _US_PER_HOUR
        + f.minute * _US_PER_MINUTE
        + f.second * 1_000_000
        + f.micro
        - f.zone_sign * (f.zone_hours * _US_PER_HOUR + f.zone_minutes * _US_PER_MINUTE)
    )
    # CASE, not AND: PostgreSQL may evaluate an AND's terms in any order, and a field's cast
    # fails the query where the text does not have the shape
    return case((valid, us))


def _in_range(us: ColumnElement[Any]) -> ColumnElement[Any]:
    return case((us.between(MIN_US, MAX_US), us))


def _layers(first: Sequence[ColumnElement[Any]], *more: Any) -> list[ColumnElement[Any]]:
    """``first`` (over the outer query's ``events`` row), then what each of ``more`` adds
    (a function of the list of columns so far), each layer a derived table evaluated once per
    row: the payload is JSON text that each use would parse again, and the fields are used
    many times each. ``OFFSET 0`` keeps PostgreSQL from merging a layer into its user,
    which would copy its expressions back into every use."""
    layer = (
        select(*(c.label(f"v{i}") for i, c in enumerate(first)))
        .correlate(_events)
        .offset(0)
        .subquery()
    )
    columns: list[ColumnElement[Any]] = list(layer.c)
    for step in more:
        added = step(columns)
        labeled = [c.label(f"v{i}") for i, c in enumerate([*columns, *added])]
        layer = select(*labeled).select_from(layer).offset(0).subquery()
        columns = list(layer.c)
    return columns


def _from_integer(ms: ColumnElement[Any]) -> ColumnElement[Any]:
    return case((ms.between(MIN_MS, MAX_MS), ms * 1000))


def _number(literal: ColumnElement[Any]) -> ColumnElement[Any]:
    return cast(literal, BigInteger)


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


# PostgreSQL -----------------------------------------------------------------------------


def _fields_at(t: ColumnElement[Any], zone: ColumnElement[Any], shaped: Any) -> _Fields:
    """The fields of ``t`` where it has the definition's form (``shaped``; else NULL), its
    zone its last ``zone`` characters, by their places: the first 16 characters are fixed,
    then ``:ss`` and ``.`` and the fraction, up to the zone. Nothing is cast elsewhere."""
    n = func.length(t)

    def at(start: Any, length: Any) -> ColumnElement[Any]:
        return case((shaped, _number(func.substr(t, start, length))))

    rest = n - 16 - zone  # characters between the minutes and the zone
    fraction = func.substr(t, 21, rest - 4)
    return _Fields(
        year=at(1, 4),
        month=at(6, 2),
        day=at(9, 2),
        hour=at(12, 2),
        minute=at(15, 2),
        second=case((rest >= 3, at(18, 2)), else_=0),
        micro=case(
            (and_(shaped, rest >= 5), _number(func.substr(fraction.op("||")("000000"), 1, 6))),
            else_=0,
        ),
        zone_sign=case((func.substr(t, n - zone + 1, 1) == "-", -1), else_=1),
        zone_hours=case((zone >= 3, at(n - zone + 2, 2)), else_=0),
        zone_minutes=case((zone >= 5, at(n - 1, 2)), else_=0),
    )


# the definition's form: ASCII digits ([0-9]: \d may take other scripts' digits), upper
# case. No capture groups: PostgreSQL's engine then only answers whether it matches, fast
# (regexp_match with groups took ~0.7 ms a row); the fields are read by their places.
_PG_ISO = (
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[T ][0-9]{2}:[0-9]{2}"
    r"(?::[0-9]{2}(?:\.[0-9]+)?)?(?:Z|[+-][0-9]{2}(?::?[0-9]{2})?)?$"
)


def _postgres_entry_us() -> ColumnElement[Any]:
    # events.payload is json (exact text), not jsonb: the json_* functions
    columns = _layers(
        [func.json_extract_path(_events.c.payload, "timestamp")],  # the one parse of the row
        lambda c: [
            func.json_typeof(c[0]),
            c[0].op("#>>")(literal_column("ARRAY[]::text[]")),  # as ->> gives it: the literal
        ],
        lambda c: [and_(c[1] == "string", c[2].op("~")(_PG_ISO)), _postgres_zone(c[2])],
        lambda c: list(_fields_at(c[2], c[4], c[3])),
        lambda c: [_unchecked_us(_Fields(*c[5:]))],
    )
    kind, text, text_us = columns[1], columns[2], columns[-1]
    return select(
        case(
            (kind == "number", _postgres_number_us(text)),
            else_=_in_range(text_us),
        )
    ).scalar_subquery()


def _postgres_zone(t: ColumnElement[Any]) -> ColumnElement[Any]:
    """The length of the zone ending ``t`` where ``t`` has the form (where a sign can only
    start its zone)."""
    n = func.length(t)
    sign = ["+", "-"]
    return case(
        (func.substr(t, n, 1) == "Z", 1),
        (func.substr(t, n - 5, 1).in_(sign), 6),
        (func.substr(t, n - 4, 1).in_(sign), 5),
        (func.substr(t, n - 2, 1).in_(sign), 3),
        else_=0,
    )


def _postgres_days(f: _Fields) -> ColumnElement[Any]:
    """make_date is exact for a valid date of years 1-9999 (and fails on any other)."""
    made = func.make_date(cast(f.year, Integer), cast(f.month, Integer), cast(f.day, Integer))
    return cast(made.op("-")(literal(date(1970, 1, 1), Date)), BigInteger)


def _postgres_number_us(literal: ColumnElement[Any]) -> ColumnElement[Any]:
    """A JSON number's literal (valid JSON: PostgreSQL checked it) as SQLite reads it: an
    integer exactly, anything else as a double. Every cast is guarded, so no literal can
    fail the query (a numeric overflows past 131,072 digits; a double past 1e308 and below
    1e-307)."""
    exact = cast(literal, Numeric)
    micros = func.floor(cast(exact, Float(precision=53)) * 1000.0)
    return case(
        (
            func.ltrim(literal, "-").op("~")("^[0-9]+$"),
            case((func.length(literal) <= 17, _from_integer(_number(literal)))),
        ),
        (
            and_(func.length(literal) <= 40, literal.op("!~")("[eE][+-]?[0-9]{4}")),
            case(
                (func.abs(exact) < _TINY, case((exact < _NEGATIVE_ZERO, -1), else_=0)),
                (
                    func.abs(exact) < _HUGE,
                    case((micros.between(MIN_US, MAX_US), cast(micros, BigInteger))),
                ),
            ),
        ),
    )


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
