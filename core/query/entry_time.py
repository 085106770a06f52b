"""An event's entry time: the payload's own ``timestamp``, as epoch milliseconds in SQL
(``events --since/--until``; the time-block summary's second bound)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import TIMESTAMP, Engine, Numeric, and_, case, cast, func
from sqlalchemy.sql.elements import ColumnElement

from core.db import is_sqlite
from core.models import EventRow, table_of

_events = table_of(EventRow)

# ISO 8601 date-times that PostgreSQL's timestamptz cast accepts: checked before the cast, so
# an odd ``timestamp`` string makes the event not match rather than fail the whole query. The
# cast raises on any impossible field (2025-02-30, month 13, hour 25, year 0, a zone past
# 15:59), so each field is checked for its range here, the day against its month and year.
_DAY = (
    r"(?!0000)(\d{4}-((0[1-9]|1[0-2])-(0[1-9]|1\d|2[0-8])|(0[13-9]|1[0-2])-(29|30)|(0[13578]|1[02])-31)"
    r"|(\d\d(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)-02-29)"
)
_TIME = r"(([01]\d|2[0-3]):[0-5]\d(:[0-5]\d(\.\d+)?)?|24:00(:00(\.0+)?)?)"
_PG_ISO = rf"^({_DAY})[T ]{_TIME}(Z|[+-](0\d|1[0-5])(:?[0-5]\d)?)?$"
_PG_ZONED = r"\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}(:?\d{2})?)$"


def entry_ms(engine: Engine) -> ColumnElement[Any]:
    """The payload's ``timestamp`` in epoch milliseconds, whether stored as a number (epoch
    ms) or ISO 8601 text (UTC when it names no zone); NULL when absent or unreadable."""
    if is_sqlite(engine):
        kind = func.json_type(_events.c.payload, "$.timestamp")
        value = func.json_extract(_events.c.payload, "$.timestamp")
        return case(
            (kind.in_(["integer", "real"]), value),
            # SQLite's date functions keep whole milliseconds; rounding removes the float
            # error of julianday (an entry at .123 s came out as ...122.997 ms, below itself)
            (
                # julianday rolls an impossible day over (2025-02-30 is 2025-03-02), and takes
                # year 0: neither matches, as on PostgreSQL
                and_(
                    kind == "text",
                    func.substr(value, 1, 10) >= "0001",
                    func.date(func.julianday(func.substr(value, 1, 10)))
                    == func.substr(value, 1, 10),
                ),
                func.round((func.julianday(value) - 2440587.5) * 86_400_000.0),
            ),
        )
    text = func.json_extract_path_text(_events.c.payload, "timestamp")  # payload->>'timestamp'
    kind = func.json_typeof(func.json_extract_path(_events.c.payload, "timestamp"))
    return case(
        (kind == "number", cast(text, Numeric)),
        # zoned text: the zone it names; text without a zone: UTC, as on SQLite
        (
            and_(kind == "string", text.op("~")(_PG_ISO), text.op("~")(_PG_ZONED)),
            func.extract("epoch", cast(text, TIMESTAMP(timezone=True))) * 1000,
        ),
        (
            and_(kind == "string", text.op("~")(_PG_ISO)),
            func.extract("epoch", func.timezone("UTC", cast(text, TIMESTAMP()))) * 1000,
        ),
    )


def entry_day(engine: Engine, fallback: ColumnElement[Any]) -> ColumnElement[Any]:
    """The day (``YYYY-MM-DD``, its first ten characters) of the entry's own ISO
    ``timestamp`` (an imported session's events were all recorded on the import's day), else
    ``fallback`` (the day the journal recorded it)."""
    if is_sqlite(engine):
        is_text = func.json_type(_events.c.payload, "$.timestamp") == "text"
        stamp = func.json_extract(_events.c.payload, "$.timestamp")
    else:
        # events.payload is json (exact text), not jsonb: the json_* functions
        is_text = func.json_typeof(func.json_extract_path(_events.c.payload, "timestamp")) == (
            "string"
        )
        stamp = func.json_extract_path_text(_events.c.payload, "timestamp")
    return case((is_text, func.substr(stamp, 1, 10)), else_=fallback)
