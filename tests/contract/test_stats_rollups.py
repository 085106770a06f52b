"""``stats()`` reads the rollup of sealed blocks (core.query.rollups) and the live events for
the rest, and returns exactly what aggregating every event returns, on both backends: with
recorded_at out of order across positions, forks (inherited copies), blobs, two tenants and
a move between them, sessions deleted after their blocks were rolled up, time bounds that
cut blocks, a reader that may not write the rollup, and a roll-up that fails half way."""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select, update
from sqlalchemy.exc import OperationalError, ProgrammingError

from core import SessionStore, Settings
from core.errors import SessionStoreError
from core.models import EventRollupBlockRow, EventRollupRow, EventRow, table_of
from core.query import rollups
from core.query.stats import Stats, stats

BASE = datetime(2026, 11, 1, tzinfo=UTC)
_events = table_of(EventRow)
_rollups = table_of(EventRollupRow)
_marks = table_of(EventRollupBlockRow)
MODELS = ("claude-sonnet-4-5", "gpt-5", None)


def _events_for(n: int, variant: int, entry_day: int | None) -> list[dict[str, Any]]:
    """``n`` entries of several kinds: assistant messages with usage (some split Claude Code
    responses, some without a model), user messages, custom events, big tool outputs (blobs)."""
    out: list[dict[str, Any]] = []
    for i in range(n):
        kind = (variant + i) % 5
        stamp = None if entry_day is None else f"2026-10-{10 + entry_day:02d}T12:00:{i % 60:02d}Z"
        if kind == 0:
            model = MODELS[(variant + i) % len(MODELS)]
            message: dict[str, Any] = {
                "role": "assistant",
                "content": [{"type": "text", "text": f"a{i}"}],
                "usage": {
                    "input": 100 + i,
                    "output": variant,
                    "cacheRead": 3,
                    "totalTokens": 7 * i,
                    "cost": {"total": 0.125 * (i % 3)} if i % 2 else 0.5,
                },
            }
            if model is not None:
                message["model"] = model
            event: dict[str, Any] = {"type": "message", "message": message}
            if i % 4 == 3:
                event["claudeCode"] = {"responseLine": i % 2}
        elif kind == 1:
            event = {"type": "message", "message": {"role": "user", "content": f"u{i}"}}
        elif kind == 2:
            event = {"type": "custom", "customType": "note", "data": i}
        elif kind == 3:  # a big tool output: a blob (one of two contents: dedup across events)
            text = f"big output {i % 2} " * 2000
            event = {
                "type": "message",
                "message": {
                    "role": "toolResult",
                    "toolCallId": f"c{i}",
                    "content": [{"type": "text", "text": text}],
                },
            }
        else:
            event = {"type": "model_change", "provider": "x", "modelId": f"m{variant}"}
        if stamp is not None:
            event["timestamp"] = stamp
        out.append(event)
    return out


UNIT = timedelta(hours=3)  # eight to a day: appends and bounds fall on many days


def _append_at(
    store: SessionStore, sid: str, n: int, unit: int, variant: int, day: int | None
) -> None:
    """``n`` events recorded at BASE + ``unit`` * 3 h (an import, or a clock that went
    back), with entry days 2026-10-(10 + ``day``) (none if None)."""
    result = store.append(sid, _events_for(n, variant, day))
    with store.engine.begin() as conn:
        conn.execute(
            update(_events)
            .where(_events.c.position.in_(result.positions))
            .values(recorded_at=BASE + unit * UNIT)
        )


def _everything_live(store: SessionStore, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> Stats:
    """The oracle: every event aggregated live (the rollup neither read nor written)."""
    with monkeypatch.context() as m:
        m.setattr(rollups, "roll_up", lambda *a, **k: 0)
        m.setattr(rollups, "plan", lambda *a, **k: rollups.Plan(0, [], None, []))
        return stats(store.engine, **kw)


def _same(got: Stats, want: Stats) -> None:
    a, b = got.to_dict(), want.to_dict()
    _close(a, b, "stats")


def _close(a: Any, b: Any, where: str) -> None:
    """Equal, floats within rounding (sums added in another order)."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), where
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9), (where, a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a, b)
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _rolled_blocks(store: SessionStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).where(_marks.c.rolled.is_(True))).scalar_one())


append = st.tuples(
    st.just("append"),
    st.integers(0, 5),  # session slot
    st.integers(1, 9),  # events
    st.integers(0, 24),  # recorded at, in units of 3 h: days 0-3
    st.integers(0, 4),  # variant
    st.none() | st.integers(0, 3),  # entry day
)
operation = st.one_of(
    append,
    append,  # three times as likely as the others
    append,
    st.tuples(st.just("fork"), st.integers(0, 5)),
    st.tuples(st.just("delete"), st.integers(0, 5)),
    st.tuples(st.just("move"), st.integers(0, 5)),
    st.tuples(
        st.just("stats"),
        st.none() | st.integers(-2, 26),  # since, in units (on a unit: often a day's start)
        st.none() | st.integers(-2, 26),  # until
        st.sampled_from([None, "acme", "beta"]),
        st.booleans(),
        st.sampled_from([0, 1, 90]),  # minutes past the unit: bounds that cut a day
    ),
)


@settings(
    max_examples=25,  # each example adds to one store: later ones take longer
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(operation, min_size=1, max_size=25))
def test_stats_from_the_rollup_equal_aggregating_every_event(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, ops: list[tuple[Any, ...]]
) -> None:
    monkeypatch.setattr(rollups, "TIME_BLOCK", 4)  # many blocks, many bounds that cut one
    monkeypatch.setattr(rollups, "ROLLUP_CHUNK_BLOCKS", 2)
    slots: list[str | None] = [
        store.create_session(tenant_id="acme" if i % 2 else "beta").id for i in range(3)
    ]
    final = [
        ("stats", None, None, None, False, 0),
        ("stats", 5, 19, "acme", True, 1),
        ("stats", 10, None, None, False, 90),
        ("stats", None, 13, "beta", False, 0),
        ("stats", 3, 21, None, False, 0),
    ]
    for op in [*ops, *final]:
        kind = op[0]
        sid = slots[op[1] % len(slots)] if kind in ("append", "fork", "delete", "move") else None
        if kind == "append" and sid is not None:
            _append_at(store, sid, *op[2:])
        elif kind == "fork" and sid is not None and len(slots) < 6:
            slots.append(store.fork(sid).id)
        elif kind == "delete" and sid is not None:
            try:
                store.delete_session(sid)
            except SessionStoreError:  # a parent whose forks still copy: not deletable yet
                continue
            slots[slots.index(sid)] = None
        elif kind == "move" and sid is not None:
            tenant = store.get_session(sid).tenant_id
            store.move(sid, tenant_id="beta" if tenant == "acme" else "acme")
        elif kind == "stats":
            _, lo, hi, tenant, inherited, past = op
            kw: dict[str, Any] = {
                "since": None if lo is None else BASE + lo * UNIT + timedelta(minutes=past),
                "until": None if hi is None else BASE + hi * UNIT + timedelta(minutes=past),
                "tenant_id": tenant,
                "include_inherited": inherited,
                "top": 3,
            }
            _same(stats(store.engine, **kw), _everything_live(store, monkeypatch, **kw))


def test_sealed_blocks_only_are_rolled_up_and_cut_days_are_read_live(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rollups, "TIME_BLOCK", 8)
    sid = store.create_session(tenant_id="acme").id
    for day in range(5):  # 5 appends of 7 events, at noon of days 0-4: positions 1-35
        _append_at(store, sid, 7, day * 8 + 4, day, 1)
    whole = stats(store.engine)
    with store.engine.connect() as conn:
        marks = conn.execute(select(_marks.c.block).order_by(_marks.c.block)).scalars().all()
        rolled = conn.execute(select(func.sum(_rollups.c.events))).scalar_one()
        head = conn.execute(select(func.max(_events.c.position))).scalar_one()
        rows = conn.execute(select(func.count()).select_from(_rollups)).scalar_one()
    assert head == 35 and marks == [0, 1, 2, 3]  # block 4 (32-39) is not sealed
    assert int(rolled) == 31  # positions 1-31 (block 0 holds 1-7)
    assert whole.events == 35
    assert rows < 31  # one row per session, day and kind, not per event
    since = BASE + timedelta(days=1, hours=6)  # cuts day 1
    until = BASE + timedelta(days=3, hours=18)  # cuts day 3
    with store.engine.connect() as conn:
        the_plan = rollups.plan(conn, since, until)
    assert the_plan.rolled_end == 32 and the_plan.unrolled == []
    assert the_plan.days == ("2026-11-03", "2026-11-04")  # day 2 only is whole
    assert the_plan.cut == [(since, BASE + timedelta(days=2)), (BASE + timedelta(days=3), until)]
    got = stats(store.engine, since=since, until=until)
    assert got.events == 21  # days 1, 2 and 3
    _same(got, _everything_live(store, monkeypatch, since=since, until=until))


def test_a_reader_that_cannot_write_the_rollup_still_counts_everything(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rollups, "TIME_BLOCK", 4)
    sid = store.create_session(tenant_id="acme").id
    for minute in (5, 1, 9, 3):
        _append_at(store, sid, 5, minute, minute, None)

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise ProgrammingError("INSERT", {}, Exception("permission denied for event_rollups"))

    monkeypatch.setattr(rollups, "write_transaction", refused)
    got = stats(store.engine)
    assert got.events == 20
    _same(got, _everything_live(store, monkeypatch))
    assert _rolled_blocks(store) == 0


def test_a_roll_up_that_fails_half_way_leaves_nothing_and_is_done_again(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The marker claim and the rows commit together: a failure after the claim (the rows'
    insert) rolls both back, and the next reader rolls the block up once."""
    monkeypatch.setattr(rollups, "TIME_BLOCK", 4)
    sid = store.create_session(tenant_id="acme").id
    _append_at(store, sid, 9, 1, 0, 2)
    real = rollups._upsert
    calls = 0

    def failing(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        raise OperationalError("INSERT", {}, Exception("disk I/O error"))

    monkeypatch.setattr(rollups, "_upsert", failing)
    assert rollups.roll_up(store.engine) == 0 and calls == 1
    with store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(_marks)).scalar_one() == 0
        assert conn.execute(select(func.count()).select_from(_rollups)).scalar_one() == 0
    monkeypatch.setattr(rollups, "_upsert", real)
    assert rollups.roll_up(store.engine) == 2  # blocks 0 (1-3) and 1 (4-7); 8-9 unsealed
    assert rollups.roll_up(store.engine) == 0  # nothing twice
    with store.engine.connect() as conn:
        assert int(conn.execute(select(func.sum(_rollups.c.events))).scalar_one()) == 7
    _same(stats(store.engine), _everything_live(store, monkeypatch))


def test_deleting_a_session_removes_its_rollup_rows(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rollups, "TIME_BLOCK", 4)
    keep, gone = (store.create_session(tenant_id="acme").id for _ in range(2))
    _append_at(store, keep, 6, 1, 0, None)
    _append_at(store, gone, 6, 2, 1, None)
    _append_at(store, keep, 6, 3, 2, None)
    assert stats(store.engine).events == 18
    store.delete_session(gone)
    with store.engine.connect() as conn:
        left = conn.execute(select(_rollups.c.session_id).distinct()).scalars().all()
    assert left == [keep]
    got = stats(store.engine)
    assert got.events == 12 and got.active_sessions == 1
    _same(got, _everything_live(store, monkeypatch))


def test_rollup_rows_of_a_session_deleted_meanwhile_are_not_counted(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A roll-up racing a delete on PostgreSQL can insert rows for the deleted session after
    the delete removed its rows: readers count only sessions that exist."""
    monkeypatch.setattr(rollups, "TIME_BLOCK", 4)
    keep, gone = (store.create_session(tenant_id="acme").id for _ in range(2))
    _append_at(store, keep, 8, 1, 0, None)
    _append_at(store, gone, 8, 1, 1, None)
    rollups.roll_up(store.engine)
    with store.engine.begin() as conn:  # what the race leaves: the rows, after the delete
        orphans = [dict(r._mapping) for r in conn.execute(select(_rollups))]
    store.delete_session(gone)
    with store.engine.begin() as conn:
        for row in orphans:
            if row["session_id"] == gone:
                del row["id"]
                conn.execute(_rollups.insert().values(**row))
    got = stats(store.engine)
    assert got.events == 8
    _same(got, _everything_live(store, monkeypatch))


def test_a_block_whose_sums_overflow_sqlite_is_read_live(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only data stored before write validation can hold such sums; the block stays exact."""
    monkeypatch.setattr(rollups, "TIME_BLOCK", 4)
    sid = store.create_session(tenant_id="acme").id
    huge = {
        "type": "message",
        "message": {"role": "assistant", "content": [], "usage": {"input": 2**62}},
    }
    store.append(sid, [huge] * 4 + [{"type": "custom", "data": 1}] * 5)
    got = stats(store.engine)
    with store.engine.connect() as conn:
        marks = dict(conn.execute(select(_marks.c.block, _marks.c.rolled)).all())
    if store.engine.dialect.name == "sqlite":
        assert marks == {0: False, 1: True}  # block 0: positions 1-3, three of 2**62
    else:  # numeric sums on PostgreSQL never overflow
        assert marks == {0: True, 1: True}
    assert got.tokens.input == pytest.approx(2**63 - 1)  # saturated, with a warning
    _same(got, _everything_live(store, monkeypatch))


def test_a_roll_up_committing_while_stats_read_is_counted_once(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stats() reads the markers, the rollup and the live events in one snapshot: a roll-up
    that commits between its statements is invisible to it, markers and figures alike (with
    a snapshot per statement, its blocks were counted live and again in the rollup)."""
    monkeypatch.setattr(rollups, "TIME_BLOCK", 4)
    sid = store.create_session(tenant_id="acme").id
    _append_at(store, sid, 6, 4, 0, 1)
    assert stats(store.engine).events == 6  # block 0 (positions 1-3) rolled up
    _append_at(store, sid, 6, 5, 1, 1)  # head 12: blocks 1 (4-7) and 2 (8-11) sealed
    real_plan, real_roll_up = rollups.plan, rollups.roll_up
    raced = 0

    def racing_plan(conn: Any, *args: Any) -> rollups.Plan:
        nonlocal raced
        found = real_plan(conn, *args)
        raced += real_roll_up(store.engine)  # another reader, in its own transaction
        return found

    monkeypatch.setattr(rollups, "plan", racing_plan)
    monkeypatch.setattr(rollups, "roll_up", lambda *a, **k: 0)  # not before the read
    got = stats(store.engine)
    assert raced == 2 and got.events == 12


def test_the_roll_up_reports_its_progress_per_transaction(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rollups, "TIME_BLOCK", 4)
    monkeypatch.setattr(rollups, "ROLLUP_CHUNK_BLOCKS", 2)
    sid = store.create_session(tenant_id="acme").id
    _append_at(store, sid, 9, 1, 0, None)
    _append_at(store, sid, 9, 2, 1, None)  # head 18: blocks 0-3 sealed (positions up to 15)
    calls: list[tuple[str, int, int | None]] = []
    got = store.stats(progress=lambda *a: calls.append(a))
    assert calls == [("rollup", 0, 4), ("rollup", 2, 4), ("rollup", 4, 4)]
    assert got.events == 18
    calls.clear()
    store.stats(progress=lambda *a: calls.append(a))
    assert calls == []  # nothing new to roll up: no bar


def test_bounds_before_the_year_1000_compare_as_days(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollup's days are compared as text: ``strftime("%Y")`` gave '500-01-01' for
    the year 500, which sorts after '2026-11-01' (found in review)."""
    monkeypatch.setattr(rollups, "TIME_BLOCK", 4)
    sid = store.create_session(tenant_id="acme").id
    _append_at(store, sid, 10, 4, 0, 1)
    assert stats(store.engine).events == 10  # rolled up
    ancient = datetime(500, 1, 1, tzinfo=UTC)
    assert stats(store.engine, until=ancient).events == 0
    assert stats(store.engine, since=ancient).events == 10
    assert stats(store.engine, since=datetime(1, 1, 1, tzinfo=UTC)).events == 10


def test_token_totals_add_the_groups_exactly(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Totals over several (day, model) groups are added as one SQL sum would: exact
    decimals on PostgreSQL (0.1 + 0.2 is 0.3 there), correctly rounded floats on SQLite."""
    monkeypatch.setattr(rollups, "TIME_BLOCK", 4)
    sid = store.create_session(tenant_id="acme").id

    def message(model: str, cost: float) -> dict[str, Any]:
        usage = {"input": 1, "cost": cost}
        return {"type": "message", "message": {"role": "assistant", "model": model, "usage": usage}}

    store.append(sid, [message("a", 0.1), message("b", 0.2)])
    got = stats(store.engine)
    if store.engine.dialect.name == "postgresql":
        assert got.tokens.cost == 0.3  # 0.1 + 0.2 in floats is 0.30000000000000004
    else:
        assert got.tokens.cost == 0.1 + 0.2  # what SQLite's own sum gives
    assert got.tokens.input == 2
    assert [u.model for u in got.usage_by_day] == ["a", "b"]


def test_usage_rows_without_a_model_come_after_the_models(store: SessionStore) -> None:
    sid = store.create_session(tenant_id="acme").id
    bare = {"type": "message", "message": {"role": "assistant", "usage": {"input": 1}}}
    named = {"type": "message", "message": {"role": "assistant", "model": "m", "usage": {}}}
    store.append(sid, [bare, named])
    assert [u.model for u in stats(store.engine).usage_by_day] == ["m", None]


def test_naive_bounds_are_refused_with_a_clear_error(store: SessionStore) -> None:
    with pytest.raises(ValueError, match="naive datetime"):
        stats(store.engine, since=datetime(2026, 11, 1))


@pytest.fixture
def pg_store(pg_url: str, tmp_path: Path) -> Iterator[SessionStore]:
    settings = Settings(data_dir=tmp_path / "data", database_url=pg_url)
    with SessionStore.from_settings(settings) as store:
        yield store


@pytest.mark.postgres
def test_a_role_that_may_not_read_the_rollup_gets_every_figure_live(
    pg_store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An analyst's role granted SELECT before migration 0014 cannot read the new tables:
    stats() reads every event instead (in a savepoint, so the snapshot stays usable)."""
    import uuid

    from core.db import make_engine

    monkeypatch.setattr(rollups, "TIME_BLOCK", 4)
    sid = pg_store.create_session(tenant_id="acme").id
    _append_at(pg_store, sid, 10, 4, 0, 1)
    whole = stats(pg_store.engine)  # rolled up by the owner
    role = f"analyst_{uuid.uuid4().hex[:8]}"
    url = pg_store.engine.url
    with pg_store.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN")
        conn.exec_driver_sql(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
        conn.exec_driver_sql(f"REVOKE SELECT ON event_rollups, event_rollup_blocks FROM {role}")
    analyst = make_engine(url.set(username=role).render_as_string(hide_password=False))
    try:
        _same(stats(analyst), whole)
    finally:
        analyst.dispose()
        with pg_store.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP OWNED BY {role}")
            conn.exec_driver_sql(f"DROP ROLE {role}")


@pytest.mark.postgres
def test_a_session_delete_waits_for_a_roll_up_in_progress(pg_store: SessionStore) -> None:
    """Roll-ups hold ROLLUP_LOCK shared and a delete takes it exclusively: the upsert locks
    rollup rows in no set order and the delete in index order, which could deadlock."""
    import threading

    from core.db import advisory_lock
    from core.models import ROLLUP_LOCK

    sid = pg_store.create_session(tenant_id="acme").id
    pg_store.append(sid, [{"type": "custom", "data": 1}])
    done = threading.Event()
    with pg_store.engine.begin() as conn:  # a roll-up in progress
        advisory_lock(conn, ROLLUP_LOCK, shared=True)
        deleting = threading.Thread(target=lambda: (pg_store.delete_session(sid), done.set()))
        deleting.start()
        assert not done.wait(1.0)  # the delete waits for the roll-up
    deleting.join(10)
    assert done.is_set()
