"""What counts as an entry time (the payload's own ``timestamp``: ``events --since/--until``)
is one definition (``core.query.entry_time``), and every backend reads each stored value the
same way: one table of cases and one property, run on each backend against one answer (a
Python reading of the definition). A value that is no entry time matches no entry bound, and
no stored value makes a listing or the time-block summary fail (DESIGN invariant 11)."""

from __future__ import annotations

import logging
import math
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, literal, select

from core import SessionStore, Settings, entry_clock
from core.entry_clock import MAX_US, MIN_US
from core.models import EventRow, EventTimeBlockRow, table_of
from core.query import timeblocks
from core.query.analytics import EventFilter
from core.query.entry_time import entry_day, entry_us

_events = table_of(EventRow)
_blocks = table_of(EventTimeBlockRow)
_EPOCH = datetime(1970, 1, 1)
JAN_1 = 1_735_689_600_000_000  # 2025-01-01T00:00:00Z in microseconds
HOUR = 3_600_000_000


def expected(value: Any) -> int | None:
    """The definition, read by Python: the entry time in epoch microseconds, or None.

    Written apart from ``core.entry_clock`` (SQLite's reading, which uses a regular
    expression and ``datetime``): the text is read a character at a time and the day is
    numbered by Hinnant's days-from-civil arithmetic, so a mistake the two share would
    have to be made twice, in two different ways."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value * 1000 if MIN_US <= value * 1000 <= MAX_US else None
    if isinstance(value, float):
        micros = value * 1000.0
        return math.floor(micros) if MIN_US <= micros < MAX_US + 1 else None
    if not isinstance(value, str):
        return None
    return _text_us(value)


_DIGITS = "0123456789"  # ASCII only: str.isdigit() takes fullwidth and other digits too


def _number(text: str, at: int, width: int) -> int | None:
    part = text[at : at + width]
    if len(part) != width or any(c not in _DIGITS for c in part):
        return None
    return int(part)


def _days_from_civil(year: int, month: int, day: int) -> int:
    """Days from 1970-01-01 to a proleptic Gregorian date (H. Hinnant's algorithm)."""
    year -= month <= 2
    era = (year if year >= 0 else year - 399) // 400
    year_of_era = year - era * 400
    day_of_year = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    return era * 146097 + day_of_era - 719468


def _days_in_month(year: int, month: int) -> int:
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    return [31, 29 if leap else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31][month - 1]


def _offset_minutes(rest: str) -> int | None:
    """``""`` or ``Z``: 0; ``±hh``, ``±hhmm``, ``±hh:mm`` up to 23:59; else None."""
    if rest in ("", "Z"):
        return 0
    if rest[0] not in "+-":
        return None
    body = rest[1:]
    if len(body) == 5 and body[2] == ":":
        body = body[:2] + body[3:]
    if len(body) not in (2, 4):
        return None
    hours, minutes = _number(body, 0, 2), _number(body, 2, 2) if len(body) == 4 else 0
    if hours is None or minutes is None or hours > 23 or minutes > 59:
        return None
    return (hours * 60 + minutes) * (1 if rest[0] == "+" else -1)


def _text_us(text: str) -> int | None:
    fields = [_number(text, at, width) for at, width in ((0, 4), (5, 2), (8, 2), (11, 2), (14, 2))]
    if any(f is None for f in fields) or (text[4:5], text[7:8], text[13:14]) != ("-", "-", ":"):
        return None
    if text[10:11] not in ("T", " ") or len(text) < 16:
        return None
    year, month, day, hour, minute = (f or 0 for f in fields)  # none is None (above)
    at, second, fraction = 16, 0, 0
    if text[at : at + 1] == ":":
        seconds = _number(text, at + 1, 2)
        if seconds is None:
            return None
        second, at = seconds, at + 3
        if text[at : at + 1] == ".":
            end = at + 1
            while end < len(text) and text[end] in _DIGITS:
                end += 1
            if end == at + 1:
                return None
            fraction, at = int((text[at + 1 : end] + "000000")[:6]), end
    offset = _offset_minutes(text[at:])
    if offset is None or not (1 <= year and 1 <= month <= 12):
        return None
    if not (1 <= day <= _days_in_month(year, month) and hour <= 23 and minute <= 59):
        return None
    if second > 59:
        return None
    clock = ((hour * 60 + minute - offset) * 60 + second) * 1_000_000 + fraction
    micros = _days_from_civil(year, month, day) * 86_400_000_000 + clock
    return micros if MIN_US <= micros <= MAX_US else None


# (stored timestamp, its entry time in µs or None): each backend must give exactly these
CASES: list[tuple[Any, int | None]] = [
    # accepted text: every form of the definition
    ("2025-01-01T00:00:00Z", JAN_1),
    ("2025-01-01T00:00:00", JAN_1),  # no zone: UTC
    ("2025-01-01 00:00:00", JAN_1),
    ("2025-01-01T00:00Z", JAN_1),
    ("2025-01-01T00:00", JAN_1),
    ("2025-01-01T00:00:00.5Z", JAN_1 + 500_000),
    ("2025-01-01T00:00:00.123456Z", JAN_1 + 123_456),
    ("2025-01-01T00:00:00.9999999Z", JAN_1 + 999_999),  # past microseconds: dropped
    ("2025-01-01T00:00:00.000+00:00", JAN_1),
    ("2025-01-01T12:00:00-00:00", JAN_1 + 12 * HOUR),
    ("2025-01-01T00:00:00+14:00", JAN_1 - 14 * HOUR),
    ("2025-01-01T00:00:00+15:00", JAN_1 - 15 * HOUR),
    ("2025-01-01T00:00:00+23:59", JAN_1 - 23 * HOUR - 59 * 60_000_000),
    ("2025-01-01T00:00:00-1530", JAN_1 + 15 * HOUR + 30 * 60_000_000),
    ("2025-01-01T00:00:00+0530", JAN_1 - 5 * HOUR - 30 * 60_000_000),
    ("2025-01-01T00:00:00+05", JAN_1 - 5 * HOUR),
    ("2025-01-01T00:00-05", JAN_1 + 5 * HOUR),
    ("2025-01-01T00:00:00.25-05:30", JAN_1 + 5 * HOUR + 30 * 60_000_000 + 250_000),
    ("2025-01-01T23:59:59.999Z", JAN_1 + 24 * HOUR - 1000),
    ("2024-02-29T12:00:00Z", 1_709_208_000_000_000),
    ("2000-02-29T00:00:00Z", 951_782_400_000_000),
    ("1969-12-31T23:59:59.999999Z", -1),
    ("0001-01-01T00:00:00Z", MIN_US),
    ("9999-12-31T23:59:59.999999Z", MAX_US),
    ("9999-12-31T23:59:59Z", MAX_US - 999_999),
    ("2025-01-01T00:00:00." + "1" * 16_000 + "Z", JAN_1 + 111_111),  # a long fraction
    # rejected text
    ("2025-01-01", None),  # a date alone
    ("2025-01-01T24:00:00Z", None),
    ("2025-01-01T24:30:00Z", None),
    ("2025-01-01T00:60:00Z", None),
    ("2025-01-01T00:00:60Z", None),  # no leap second
    ("2025-01-01T00:00:00+24:00", None),
    ("2025-01-01T00:00:00+05:60", None),
    ("2025-01-01T00:00:00+5", None),
    ("2025-01-01T00:00:00+05:3", None),
    ("2025-01-01T00:00:00 Z", None),
    (" 2025-01-01T00:00:00Z", None),
    ("2025-01-01T00:00:00Z ", None),
    ("2025-01-01T00:00:00Z\n", None),
    ("2025-01-01t00:00:00z", None),
    ("2025-01-01T00:00:00.Z", None),
    ("2025-01-01T00:00:00.5+05:30Z", None),
    ("2025-01-01T00:00:00GMT", None),
    ("2025-01-01T00:00:00+05:30:00", None),
    ("2025-W01-1", None),
    ("20250101T000000Z", None),
    ("2025-1-01T00:00:00Z", None),
    ("\uff12\uff10\uff12\uff15-01-01T00:00:00Z", None),  # fullwidth digits: not ASCII
    ("2025-02-29T00:00:00Z", None),
    ("1900-02-29T00:00:00Z", None),
    ("2025-04-31T00:00:00Z", None),
    ("2025-13-01T00:00:00Z", None),
    ("2025-00-10T00:00:00Z", None),
    ("2025-01-00T00:00:00Z", None),
    ("0000-01-01T00:00:00Z", None),
    ("0001-01-01T00:00:00+00:01", None),  # before the first instant a bound can name
    ("9999-12-31T23:59:59.999999-00:01", None),  # after the last
    ("1735689600000", None),  # a number as text
    ("NaN", None),
    ("Infinity", None),
    ("", None),
    ("2025-01-01T00:00:00\x00Z", None),
    ("9" * 16_000, None),  # (longer strings are stored as blobs: see the test of huge ones)
    ("2025-01-01T00:00:00." + "x" * 16_000, None),
    # numbers: epoch milliseconds
    (1_735_689_600_000, JAN_1),
    (1_735_689_600_000.5, JAN_1 + 500),
    (1_735_689_600_000.0004, JAN_1),  # floored to the microsecond
    (-1, -1000),
    (-0.0004, -1),
    (0, 0),
    (-0.0, 0),
    (5e-324, 0),
    (-5e-324, -1),
    (-62_135_596_800_000, MIN_US),
    (-62_135_596_800_001, None),
    (253_402_300_799_999, MAX_US - 999),
    (253_402_300_799_999.9, math.floor(253_402_300_799_999.9 * 1000.0)),
    (253_402_300_800_000, None),
    # times 1000 these round (as doubles) to MAX_US + 1, one past the range: a bound of
    # MAX_US converted to a double is that same value, so "<= MAX_US" let them in
    (253_402_300_800_000.0, None),
    (253_402_300_799_999.98, math.floor(253_402_300_799_999.98 * 1000.0)),  # the last below
    (-62_135_596_800_000.0, MIN_US),
    (1e20, None),
    (1e308, None),
    (-1e308, None),
    (2**63, None),
    (-(2**63) - 1, None),
    (10**309, None),
    (-(10**309), None),
    (10**4000, None),
    # no entry time at all
    (True, None),
    (None, None),
    ({"ms": 1}, None),
    ([1_735_689_600_000], None),
]


def _append(store: SessionStore, values: list[Any]) -> str:
    session = store.create_session(tenant_id="acme").id
    store.append(
        session, [{"type": "custom", "i": i, "timestamp": v} for i, v in enumerate(values)]
    )
    return session


def _read(store: SessionStore, session: str) -> list[int | None]:
    query = (
        select(entry_us(store.engine))
        .where(_events.c.session_id == session)
        .order_by(_events.c.seq)
    )
    with store.engine.connect() as conn:
        return [None if v is None else int(v) for v in conn.execute(query).scalars()]


def test_the_python_reading_agrees_with_the_table() -> None:
    assert [expected(v) for v, _ in CASES] == [want for _, want in CASES]


def test_every_backend_reads_the_table_of_cases_alike(store: SessionStore) -> None:
    session = _append(store, [v for v, _ in CASES])
    got = _read(store, session)
    wrong = [
        (v if len(repr(v)) < 80 else repr(v)[:80], want, have)
        for (v, want), have in zip(CASES, got, strict=True)
        if want != have
    ]
    assert wrong == []


def _day_written(value: Any) -> str | None:
    """The day ``stats`` counts an assistant message on, read by Python from the definition:
    an ISO text's own date, a number's UTC date, or None (the day it was recorded)."""
    us = expected(value)
    if us is None:
        return None
    if isinstance(value, str):
        return value[:10]
    return (_EPOCH + timedelta(microseconds=us)).date().isoformat()


def test_the_entry_day_is_the_day_of_the_entry_time(store: SessionStore) -> None:
    """Each case of the table: ``entry_day`` gives the date an entry time was written on (a
    number's UTC date, the floor before 1970 too), or the fallback where the value is no
    entry time (text such as ``"2025-01-01"`` alone or ``"2025-02-29T…"`` used to count)."""
    session = _append(store, [v for v, _ in CASES])
    query = (
        select(entry_day(store.engine, literal("recorded")))
        .where(_events.c.session_id == session)
        .order_by(_events.c.seq)
    )
    with store.engine.connect() as conn:
        got = list(conn.execute(query).scalars())
    want = [_day_written(v) or "recorded" for v, _ in CASES]
    wrong = [(repr(v)[:60], w, g) for (v, _), w, g in zip(CASES, want, got, strict=True) if w != g]
    assert wrong == []
    assert {"1969-12-31", "0001-01-01", "9999-12-31", "recorded"} <= set(got)


def test_stats_count_usage_on_the_entry_day(store: SessionStore) -> None:
    """A hostile ``timestamp`` is not a day in ``stats``: it falls back to the recorded day."""
    session = store.create_session(tenant_id="acme").id
    stamps = ["2025-01-01T23:30:00-05:00", 1_735_776_000_000, "yesterday", "2025-02-30T00:00Z"]
    store.append(
        session,
        [
            {
                "type": "message",
                "timestamp": stamp,
                "message": {
                    "role": "assistant",
                    "model": "m",
                    "content": [],
                    "usage": {"input": 1},
                },
            }
            for stamp in stamps
        ],
    )
    today = datetime.now(UTC).date().isoformat()
    days = {u.day: u.responses for u in store.stats().usage_by_day}
    assert days == {"2025-01-01": 1, "2025-01-02": 1, today: 2}


@pytest.mark.parametrize(
    "bound",
    [
        JAN_1 - 15 * HOUR,
        JAN_1,
        JAN_1 + 1,
        JAN_1 + 500,
        JAN_1 + 111_111,
        JAN_1 + 12 * HOUR,
        MIN_US,
        MAX_US,
        -1,
        0,
    ],
)
def test_since_and_until_select_by_the_entry_time(store: SessionStore, bound: int) -> None:
    """since inclusive, until exclusive, to the microsecond, whatever else is stored."""
    session = _append(store, [v for v, _ in CASES])
    when = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=bound)
    for field, keep in (
        ("entry_since", lambda t: t >= bound),
        ("entry_until", lambda t: t < bound),
    ):
        flt = EventFilter(session_id=session, **{field: when})
        found = [e.payload["i"] for e in store.list_events(flt, limit=1000).items]
        assert found == [i for i, (_, t) in enumerate(CASES) if t is not None and keep(t)]


def test_a_bound_with_an_offset_is_the_same_instant(store: SessionStore) -> None:
    session = _append(store, ["2025-01-01T05:30:00+05:30", "2025-01-01T00:00:00.000001Z"])
    at = datetime(2025, 1, 1, 5, 30, tzinfo=timezone(timedelta(hours=5, minutes=30)))
    found = store.list_events(
        EventFilter(session_id=session, entry_until=at + timedelta(microseconds=1))
    )
    assert [e.payload["i"] for e in found.items] == [0]


text_timestamps = st.builds(
    lambda when, sep, seconds, fraction, zone: (
        f"{when.year:04d}-{when.month:02d}-{when.day:02d}{sep}{when.hour:02d}:{when.minute:02d}"
        + (f":{when.second:02d}{fraction}" if seconds else "")
        + zone
    ),
    st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31, 23, 59, 59)),
    st.sampled_from(["T", " ", "t", "_"]),
    st.booleans(),
    st.sampled_from(["", "."]).flatmap(
        lambda dot: st.just("") if not dot else st.text("0123456789", max_size=9).map(dot.__add__)
    ),
    st.one_of(
        st.sampled_from(["", "Z", "z", " Z", "GMT"]),
        st.tuples(
            st.sampled_from("+-"),
            st.integers(0, 25),
            st.integers(0, 61),
            st.sampled_from([":", "", None]),
        ).map(lambda z: f"{z[0]}{z[1]:02d}" + ("" if z[3] is None else f"{z[3]}{z[2]:02d}")),
    ),
)
noise = st.text(alphabet="0123456789-:T Z+.", max_size=30)
numbers = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(min_value=-6.3e13, max_value=2.6e14),
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(st.one_of(text_timestamps, noise, numbers), min_size=1, max_size=30))
def test_any_stored_timestamp_reads_as_the_definition_says(
    store: SessionStore, values: list[Any]
) -> None:
    assert _read(store, _append(store, values)) == [expected(v) for v in values]


@settings(max_examples=3000, deadline=None)
@given(st.one_of(text_timestamps, noise, st.text(max_size=40)))
def test_sqlites_reading_agrees_with_the_independent_one(value: str) -> None:
    """SQLite's function (``core.entry_clock``) against this file's reading, written apart,
    on many texts: cheap here (no database), so many more than the stored property."""
    assert entry_clock.entry_us_of("text", value, None) == expected(value)


def test_hostile_values_fail_no_listing_and_no_summary(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One event each (10**309 made every entry-bounded listing fail on PostgreSQL, and the
    time-block summary fail for good at DEBUG): they match nothing; the summary covers them
    and bounds the blocks of the others."""
    monkeypatch.setattr(timeblocks, "TIME_BLOCK", 4)
    hostile = [10**309, -(10**309), 1e308, -1e308, 2**63, "NaN", "9" * 100_000, 10**4000]
    good = "2026-11-01T00:00:00Z"
    mixed = [v for h in hostile for v in (h, good)]
    session = _append(store, mixed)
    other = _append(store, [good] * 8)  # the blocks past the hostile ones
    since = datetime(2026, 1, 1, tzinfo=UTC)
    with caplog.at_level(logging.DEBUG, logger=timeblocks.__name__):
        timeblocks.summarize(store.engine)
    assert not [r for r in caplog.records if r.name == timeblocks.__name__]
    assert _summarized(store) == (len(mixed) + 8 + 1) // 4
    for flt, count in (
        (EventFilter(entry_since=since), len(hostile) + 8),
        (EventFilter(entry_until=since), 0),
        (EventFilter(session_id=session, entry_since=datetime(1, 1, 1, tzinfo=UTC)), len(hostile)),
        (EventFilter(session_id=other, entry_until=datetime(9999, 1, 1, tzinfo=UTC)), 8),
    ):
        assert len(store.list_events(flt, limit=1000).items) == count


def test_a_summary_that_keeps_failing_is_a_warning(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(timeblocks, "TIME_BLOCK", 2)
    _append(store, ["2026-11-01T00:00:00Z"] * 5)

    def refused(*args: Any, **kwargs: Any) -> Any:
        from sqlalchemy.exc import ProgrammingError

        raise ProgrammingError("INSERT", {}, Exception("permission denied for event_time_blocks"))

    with monkeypatch.context() as patch, caplog.at_level(logging.DEBUG, timeblocks.__name__):
        patch.setattr(timeblocks, "write_transaction", refused)
        levels = [timeblocks.summarize(store.engine) for _ in range(3)]
    assert levels == [0, 0, 0] and _summarized(store) == 0
    assert [r.levelno for r in caplog.records if r.name == timeblocks.__name__] == [
        logging.DEBUG,
        logging.WARNING,
        logging.WARNING,
    ]
    caplog.clear()
    timeblocks.summarize(store.engine)  # it works again: quiet, and the count starts over
    assert _summarized(store) == 3 and not caplog.records


def test_huge_strings_are_read_whole(settings: Settings) -> None:
    """A megabyte of text where a timestamp goes (stored inline, not as a blob)."""
    values = [
        "9" * 1_000_000,
        "2025-01-01T00:00:00." + "7" * 1_000_000 + "Z",
        "2025-01-01T00:00:00." + "7" * 1_000_000 + "x",
        "2025-01-01T00:00:00Z" + " " * 1_000_000,
    ]
    roomy = settings.model_copy(update={"inline_string_limit": 2**24})
    with SessionStore.from_settings(roomy) as store:
        session = _append(store, values)
        assert _read(store, session) == [None, JAN_1 + 777_777, None, None]
        found = store.list_events(EventFilter(entry_since=datetime(2025, 1, 1, tzinfo=UTC)))
        assert [e.payload["i"] for e in found.items] == [1]


def _summarized(store: SessionStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(_blocks)).scalar_one())


def test_summarize_says_how_many_blocks_it_added(store: SessionStore) -> None:
    """The count is the rows added, on both backends (PostgreSQL's driver reported -1)."""
    session = store.create_session(tenant_id="acme").id
    for _ in range(2 * timeblocks.TIME_BLOCK // 1000 + 1):
        result = store.append(session, [{"type": "custom", "timestamp": 0}] * 1000)
    sealed = (result.positions[-1] + 1) // timeblocks.TIME_BLOCK  # blocks from position 0
    assert sealed >= 2
    assert timeblocks.summarize(store.engine) == sealed == _summarized(store)
    assert timeblocks.summarize(store.engine) == 0
