"""Time-bounded listings (``events --since``) start from the time-block summary
(core.query.timeblocks) and return exactly what a full scan returns, on both backends:
with recorded_at out of order across positions, blocks summarized part-way through the
history, sessions deleted after their blocks were summarized, and a reader that may not
write the summary."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select, update

from core import SessionStore
from core.models import EventRow, EventTimeBlockRow, table_of
from core.query import timeblocks
from core.query.analytics import EventFilter, follow_events

BASE = datetime(2026, 11, 1, tzinfo=UTC)
_events = table_of(EventRow)
_blocks = table_of(EventTimeBlockRow)


def _event(i: int, entry_minute: int | None) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "message", "message": {"role": "user", "content": f"m{i}"}}
    if entry_minute is not None:  # the entry's own time, as pi writes it
        when = BASE + timedelta(minutes=entry_minute, seconds=i)
        event["timestamp"] = when.strftime("%Y-%m-%dT%H:%M:%S.000Z")
    return event


def _append_at(
    store: SessionStore, session_id: str, n: int, minute: int, entry_minute: int | None = None
) -> None:
    """``n`` events recorded at BASE + ``minute`` (an import or a clock that went back), with
    entry times from BASE + ``entry_minute`` (none if None)."""
    result = store.append(session_id, [_event(i, entry_minute) for i in range(n)])
    with store.engine.begin() as conn:
        conn.execute(
            update(_events)
            .where(_events.c.position.in_(result.positions))
            .values(recorded_at=BASE + timedelta(minutes=minute))
        )


def _paged(store: SessionStore, since: datetime, page: int, *, entry: bool = False) -> list[int]:
    flt = EventFilter(entry_since=since) if entry else EventFilter(since=since)
    found: list[int] = []
    cursor = 0
    while True:
        result = store.list_events(flt, after_position=cursor, limit=page)
        found += [e.position for e in result.items]
        if result.next_cursor is None:
            return found
        cursor = int(result.next_cursor)


def _scanned(store: SessionStore, since: datetime, *, entry: bool = False) -> list[int]:
    if not entry:
        return [e.position for e in store.read_all(limit=100_000) if e.recorded_at >= since]
    found = []
    for e in store.read_all(limit=100_000):
        stamp = e.payload.get("timestamp")
        if stamp is not None and datetime.fromisoformat(stamp) >= since:
            found.append(e.position)
    return found


operation = st.one_of(
    st.tuples(
        st.just("append"),
        st.integers(0, 3),
        st.integers(1, 9),
        st.integers(0, 60),
        st.none() | st.integers(-30, 90),
    ),
    st.tuples(st.just("list"), st.integers(-5, 65), st.integers(1, 7), st.booleans()),
    st.tuples(st.just("delete"), st.integers(0, 3)),
)


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(operation, min_size=1, max_size=25))
def test_since_listing_equals_a_full_scan(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, ops: list[tuple[Any, ...]]
) -> None:
    monkeypatch.setattr(timeblocks, "TIME_BLOCK", 4)  # many blocks, many boundaries
    sessions = [store.create_session(tenant_id="acme").id for _ in range(4)]
    live = set(range(4))
    for op in [*ops, ("list", 30, 5, False), ("list", -5, 100, False), ("list", 30, 5, True)]:
        if op[0] == "append" and op[1] in live:
            _append_at(store, sessions[op[1]], op[2], op[3], op[4])
        elif op[0] == "delete" and op[1] in live:
            store.delete_session(sessions[op[1]])
            live.discard(op[1])
        elif op[0] == "list":
            since = BASE + timedelta(minutes=op[1])
            entry = op[3]
            assert _paged(store, since, op[2], entry=entry) == _scanned(store, since, entry=entry)


def test_the_summary_covers_sealed_blocks_only_and_skips_to_the_first_match(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(timeblocks, "TIME_BLOCK", 8)
    sid = store.create_session(tenant_id="acme").id
    for minute in range(5):  # 5 appends of 7 events: positions 1-35, minute by minute
        _append_at(store, sid, 7, minute)
    since = BASE + timedelta(minutes=3)
    first = timeblocks.first_position_at_or_after(store.engine, recorded=since)
    with store.engine.connect() as conn:
        blocks = dict(conn.execute(select(_blocks.c.block, _blocks.c.max_recorded_at)).all())
        head = conn.execute(select(func.max(_events.c.position))).scalar_one()
    assert head == 35 and sorted(blocks) == [0, 1, 2, 3]  # block 4 (32-39) is not sealed
    assert blocks[2] == BASE + timedelta(minutes=3)  # positions 16-23: minutes 2 and 3
    # minute 3 starts at position 22, in block 2: the listing starts at 16, not at 1
    assert first == 16
    assert _paged(store, since, 3) == list(range(22, 36))


def test_a_reader_that_cannot_write_the_summary_still_lists_everything(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(timeblocks, "TIME_BLOCK", 4)
    sid = store.create_session(tenant_id="acme").id
    for minute in (5, 1, 9, 3):
        _append_at(store, sid, 5, minute)

    def refused(*args: Any, **kwargs: Any) -> Any:
        from sqlalchemy.exc import ProgrammingError

        raise ProgrammingError("INSERT", {}, Exception("permission denied for event_time_blocks"))

    monkeypatch.setattr(timeblocks, "write_transaction", refused)
    since = BASE + timedelta(minutes=3)
    assert _paged(store, since, 2) == _scanned(store, since)
    with store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(_blocks)).scalar_one() == 0


def test_follow_with_since_starts_at_the_summary_and_sees_later_writes(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(timeblocks, "TIME_BLOCK", 4)
    sid = store.create_session(tenant_id="acme").id
    for minute in range(6):
        _append_at(store, sid, 3, minute)
    since = BASE + timedelta(minutes=4)
    polls = iter([False, True])
    seen = [
        e.position
        for e in follow_events(
            store.engine,
            EventFilter(since=since),
            after_position=0,
            should_stop=lambda: next(polls),
            sleep=lambda _: _append_at(store, sid, 2, 10),
        )
    ]
    assert seen == _scanned(store, since)


def test_an_entry_exactly_at_since_with_a_fraction_of_a_millisecond_is_found(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry bound is stored in whole milliseconds, rounded up: never below the entry,
    which is read to the microsecond on every backend (core.query.entry_time)."""
    monkeypatch.setattr(timeblocks, "TIME_BLOCK", 4)
    sid = store.create_session(tenant_id="acme").id
    micros = 123_456
    at = BASE + timedelta(minutes=10, microseconds=micros)
    early = [{"type": "custom", "timestamp": "2026-11-01T00:01:00Z", "data": i} for i in range(7)]
    stamp = f"2026-11-01T00:10:00.{micros:06d}Z"
    exact = {"type": "custom", "timestamp": stamp, "data": "exact"}
    store.append(sid, [*early, exact, *early])  # the exact one is alone at the top of block 2
    found = _paged(store, at, 2, entry=True)
    assert found == _scanned(store, at, entry=True) and len(found) == 1


@pytest.mark.parametrize(
    "stamp",
    [
        "2025-02-30T10:00:00Z",  # no such day: PostgreSQL's cast raised, SQLite rolled it over
        "2025-02-29T10:00:00Z",  # not a leap year
        "2025-04-31T10:00:00Z",
        "2025-13-01T10:00:00Z",
        "2025-06-01T25:00:00Z",
        "0000-06-01T10:00:00Z",  # no year 0
        "2025-06-01T10:00:00+24:00",  # a zone past a day (PostgreSQL's cast stopped at 15:59)
    ],
)
def test_an_impossible_entry_time_matches_no_time_filter_and_fails_nothing(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, stamp: str
) -> None:
    monkeypatch.setattr(timeblocks, "TIME_BLOCK", 2)
    good = {"type": "custom", "timestamp": "2024-02-29T10:00:00Z", "data": "leap day"}
    bad = {"type": "custom", "timestamp": stamp, "data": "bad"}
    store.append(store.create_session(tenant_id="acme").id, [bad, good, bad, bad, good])
    since, until = datetime(1, 1, 1, tzinfo=UTC), datetime(9999, 1, 1, tzinfo=UTC)
    for flt in (EventFilter(entry_since=since), EventFilter(entry_until=until)):
        found = store.list_events(flt, limit=100).items
        assert [e.payload["data"] for e in found] == ["leap day", "leap day"]
