"""Analysts' queries on both backends: listing filters and cursors, following, stats, the
artifacts index of a state, and (PostgreSQL) the BI views."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from core import InvalidEvent, SessionStore, Settings, migrate
from core.db import make_engine
from core.query import analytics
from core.query.analytics import EventFilter, follow_events, head_position, iter_events
from core.records import Session
from tests.contract.test_projection import SessionBuilder

BIG = "x" * 40_000  # over inline_string_limit: becomes a blob


def _acme_and_globex(store: SessionStore) -> tuple[Session, Session, Session]:
    """Two acme sessions and one globex session with realistic entries."""
    a1 = store.create_session(tenant_id="acme")
    a2 = store.create_session(tenant_id="acme")
    g1 = store.create_session(tenant_id="globex")
    for session, turns in ((a1, 3), (g1, 2), (a2, 1)):
        b = SessionBuilder()
        b.header()
        for i in range(turns):
            b.turn(f"task {i}")
        b.model_change("openai", "gpt-5")
        store.append(session.id, b.events)
    return a1, a2, g1


def _positions(store: SessionStore, flt: EventFilter, **kwargs: Any) -> list[int]:
    return [e.position for e in store.list_events(flt, limit=10_000, **kwargs).items]


def test_list_events_filters(store: SessionStore) -> None:
    a1, a2, g1 = _acme_and_globex(store)
    everything = store.read_all(limit=10_000)
    assert _positions(store, EventFilter()) == [e.position for e in everything]

    acme = _positions(store, EventFilter(tenant_id="acme"))
    assert acme == [e.position for e in everything if e.session_id in {a1.id, a2.id}]
    assert {e.tenant_id for e in store.list_events(EventFilter(tenant_id="globex")).items} == {
        "globex"
    }
    assert _positions(store, EventFilter(session_id=g1.id)) == [
        e.position for e in store.read(g1.id)
    ]
    types = store.list_events(EventFilter(types=("model_change", "session")), limit=100).items
    assert sorted({e.type for e in types}) == ["model_change", "session"] and len(types) == 6

    tool_results = store.list_events(EventFilter(roles=("toolResult",)), limit=100).items
    assert len(tool_results) == 6 and {e.role for e in tool_results} == {"toolResult"}
    both = EventFilter(tenant_id="acme", roles=("user", "assistant"), types=("message",))
    assert len(_positions(store, both)) == 4 * 3  # 4 turns in acme, 3 such messages each

    now = datetime.now(UTC)
    assert _positions(store, EventFilter(since=now - timedelta(hours=1))) == [
        e.position for e in everything
    ]
    assert _positions(store, EventFilter(since=now + timedelta(hours=1))) == []
    assert _positions(store, EventFilter(until=now - timedelta(hours=1))) == []
    assert len(_positions(store, EventFilter(until=now + timedelta(hours=1)))) == len(everything)

    middle = everything[len(everything) // 2].position
    assert _positions(store, EventFilter(), after_position=middle) == [
        e.position for e in everything if e.position > middle
    ]


def test_a_role_or_model_that_is_no_string_is_none_on_every_backend(store: SessionStore) -> None:
    """A role or model that is a JSON number or boolean is none, as the fold reads it: the
    role filter ``1`` or ``true`` matched it on PostgreSQL (its JSON text) and not on
    SQLite, and stats named such models differently on each (``1.0e+16`` / ``1e+16``)."""
    sid = store.create_session(tenant_id="acme").id

    def message(role: Any, **more: Any) -> dict[str, Any]:
        return {"type": "message", "message": {"role": role, "content": "x", **more}}

    store.append(
        sid,
        [
            message(1),
            message(True),
            message("assistant", model=True),
            message("assistant", model=2**80),
            message("assistant", model=1e16),
            message("assistant", model="claude-x"),
        ],
    )
    for role in ("1", "true", "True", "1.0"):
        assert store.list_events(EventFilter(roles=(role,))).items == []
    assert [e.seq for e in store.list_events(EventFilter(roles=("assistant",))).items] == [
        3,
        4,
        5,
        6,
    ]
    models = {u.model for u in store.stats().usage_by_day}
    assert "claude-x" in models and not models & {"1", "true", "1e+16", "1.0e+16", str(2**80)}
    assert store.state(sid).info.model is not None


def test_cursor_pagination_visits_each_event_once(store: SessionStore) -> None:
    _acme_and_globex(store)
    flt = EventFilter(tenant_id="acme")
    seen: list[int] = []
    cursor = 0
    pages = 0
    while True:
        page = store.list_events(flt, after_position=cursor, limit=4)
        seen += [e.position for e in page.items]
        pages += 1
        if page.next_cursor is None:
            break
        cursor = int(page.next_cursor)
    assert seen == _positions(store, flt)
    assert pages == -(-len(seen) // 4)
    assert [e.position for e in iter_events(store.engine, flt, page_size=3)] == seen


def test_iteration_with_pages_larger_than_a_listing_returns_every_event(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing returns at most MAX_PAGE events: asked for more, iter_events read that
    short page as the end and stopped (20,000 asked, 10,000 of 12,000 returned)."""
    _acme_and_globex(store)
    every = _positions(store, EventFilter())
    monkeypatch.setattr(analytics, "MAX_PAGE", 2)
    assert [e.position for e in iter_events(store.engine, page_size=5)] == every


def test_follow_sees_later_commits_exactly_once(store: SessionStore) -> None:
    session = store.create_session(tenant_id="acme")
    other = store.create_session(tenant_id="globex")
    store.append(session.id, [{"type": "before"}])
    start = head_position(store.engine)
    batches = iter(
        [
            [(session, [{"type": "a"}, {"type": "b"}])],
            [],
            [(other, [{"type": "hidden"}]), (session, [{"type": "c"}])],
            [(session, [{"type": "d"}] * 3)],
        ]
    )
    polls = 0

    def sleep(_: float) -> None:
        nonlocal polls
        polls += 1
        for target, events in next(batches, []):
            store.append(target.id, events)

    seen = [
        e.type
        for e in follow_events(
            store.engine,
            EventFilter(tenant_id="acme"),
            after_position=start,
            poll_interval=0,
            page_size=2,
            should_stop=lambda: polls >= 6,
            sleep=sleep,
        )
    ]
    assert seen == ["a", "b", "c", "d", "d", "d"]


def test_stats(store: SessionStore) -> None:
    a1, a2, g1 = _acme_and_globex(store)
    store.append(a2.id, [{"type": "blobby", "value": BIG}])
    store.append(g1.id, [{"type": "blobby", "value": BIG}, {"type": "blobby", "value": BIG}])
    store.artifacts(a1.id).save("log line\n" * 100, "bash")

    everything = store.stats()
    assert everything.events == len(store.read_all(limit=10_000))
    assert everything.events_by_type["message"] == 6 * 4
    assert everything.events_by_type["blobby"] == 3
    assert [n for _, n in everything.events_by_day] == [everything.events]
    assert (everything.sessions, everything.active_sessions) == (3, 3)
    assert [s.session_id for s in everything.top_by_events] == [a1.id, g1.id, a2.id]
    assert everything.top_by_bytes[0].session_id == g1.id  # two blob refs
    assert everything.top_by_bytes[0].blob_bytes == 2 * len(BIG)
    assert everything.blobs.references == 3 and everything.blobs.unique_blobs == 1
    assert everything.blobs.dedup_ratio == pytest.approx(3.0)
    assert everything.artifact_bytes["tool_output"] == len("log line\n" * 100)
    assert everything.to_dict()["artifacts"]["bytes"] == len("log line\n" * 100)

    states = [store.state(s.id) for s in (a1, a2, g1)]
    usage = [s.counters.usage for s in states]
    assert everything.tokens.input == sum(u.input for u in usage)
    assert everything.tokens.total_tokens == sum(u.total_tokens for u in usage)
    assert everything.tokens.cost == pytest.approx(sum(u.cost for u in usage))

    acme = store.stats(tenant_id="acme", top=1)
    assert (acme.sessions, acme.events_by_type["message"]) == (2, 4 * 4)
    assert [s.session_id for s in acme.top_by_events] == [a1.id]
    assert acme.blobs.references == 1 and acme.blobs.dedup_ratio == pytest.approx(1.0)
    assert acme.artifact_bytes["tool_output"] == everything.artifact_bytes["tool_output"]
    assert store.stats(tenant_id="globex").artifact_bytes["tool_output"] == 0
    assert store.stats(since=datetime.now(UTC) + timedelta(hours=1)).events == 0


def test_bounds_whose_offset_leaves_the_datetime_range_act_as_its_ends(
    store: SessionStore,
) -> None:
    """0001-01-01T00:00+01:00 is before the first UTC instant datetime holds, 9999-12-31
    T23:59:59-01:00 after the last: as bounds they mean the ends of time, as the entry-time
    bounds already did, instead of an OverflowError."""
    store.append(store.create_session(tenant_id="acme").id, [{"type": "custom", "n": 1}])
    first = datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=1)))
    last = datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone(timedelta(hours=-1)))
    assert store.stats(since=first).events == 1 and store.stats(until=last).events == 1
    assert store.stats(since=last).events == 0 and store.stats(until=first).events == 0
    for flt, count in (
        (EventFilter(since=first, until=last), 1),
        (EventFilter(since=last), 0),
        (EventFilter(until=first), 0),
        (EventFilter(entry_since=first, entry_until=last), 0),  # no entry timestamp
    ):
        assert len(store.list_events(flt).items) == count


def test_state_lists_artifacts_created_up_to_at_seq(store: SessionStore) -> None:
    session = store.create_session(tenant_id="acme")
    store.append(session.id, [{"type": "x"}] * 3)
    first = store.artifacts(session.id).save("one", "bash")
    store.append(session.id, [{"type": "x"}] * 2)
    store.artifacts(session.id).save("second output", "read")

    (early,) = store.state(session.id, at_seq=4).artifacts
    assert (early.kind, early.local_id, early.size, early.created_seq) == (
        "tool_output",
        first,
        3,
        3,
    )
    assert [a.tool_type for a in store.state(session.id).artifacts] == ["bash", "read"]
    assert store.state(session.id, at_seq=2).artifacts == []


def test_state_blob_values_are_lazy(store: SessionStore) -> None:
    session = store.create_session(tenant_id="acme")
    b = SessionBuilder()
    b.user(BIG)
    store.append(session.id, b.events)
    (lazy,) = store.state(session.id).messages
    assert lazy.content != BIG and lazy.content.size == len(BIG)
    assert lazy.content.load() == BIG
    (as_stored,) = store.state(session.id, rehydrate=False).messages
    assert isinstance(as_stored.content, str) and as_stored.content.startswith("blob:sha256:")
    (exact,) = store.state(session.id, rehydrate=True).messages
    assert exact.content == BIG


# PostgreSQL: the BI views ---------------------------------------------------------------


@pytest.fixture
def pg_store(pg_url: str, tmp_path: Path) -> Iterator[SessionStore]:
    """The BI views exist on PostgreSQL only."""
    settings = Settings(data_dir=tmp_path / "data", database_url=pg_url)
    with SessionStore.from_settings(settings) as store:
        yield store


def test_bi_views_flatten_messages_and_pair_tool_calls(pg_store: SessionStore) -> None:
    store = pg_store
    session = store.create_session(tenant_id="acme")
    b = SessionBuilder()
    b.user("please list")
    _, (call,) = b.assistant("listing", tools=[("bash", {"command": "ls"})], usage=(11, 7))
    b.tool_result(call, "bash", "a.txt", error=True)
    b.assistant("there is a.txt", usage=(20, 3))
    b._entry("message", message={"role": "bashExecution", "command": "ls", "output": "a.txt"})
    b.compaction(b.leaf or "")
    store.append(session.id, b.events)

    with store.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT seq, role, text, thinking, tool_name, tool_call_names, is_error, "
                "command, model, input_tokens, output_tokens, cost "
                "FROM bi_messages WHERE tenant_id = :t AND session_id = :s ORDER BY position"
            ),
            {"t": "acme", "s": session.id},
        ).all()
        calls = conn.execute(
            text(
                "SELECT tool_call_id, tool_name, arguments, result_seq, is_error FROM bi_tool_calls"
            )
        ).all()
        (summary,) = conn.execute(
            text("SELECT events, messages, tool_calls, input_tokens, cost FROM bi_sessions")
        ).all()
        event_types = conn.execute(text("SELECT type, entry_id FROM bi_events ORDER BY seq")).all()
        documented = conn.execute(
            text("SELECT col_description('bi_messages'::regclass, 10)")
        ).scalar()

    assert [(r.seq, r.role) for r in rows] == [
        (1, "user"),
        (2, "assistant"),
        (3, "toolResult"),
        (4, "assistant"),
        (5, "bashExecution"),
    ]
    assert [r.text for r in rows] == ["please list", "listing", "a.txt", "there is a.txt", "a.txt"]
    assert rows[1].thinking == "let me see" and rows[1].tool_call_names == "bash"
    assert (rows[2].tool_name, rows[2].is_error) == ("bash", True)
    assert rows[4].command == "ls"
    assert (rows[1].model, rows[1].input_tokens, rows[1].output_tokens) == (
        "claude-sonnet-4-5",
        11,
        7,
    )
    assert float(rows[1].cost) == pytest.approx(0.375)
    assert calls == [(call, "bash", {"command": "ls"}, 3, True)]
    assert (summary.events, summary.messages, summary.tool_calls, summary.input_tokens) == (
        6,
        5,
        1,
        31,
    )
    assert [t for t, _ in event_types][-1] == "compaction"
    assert documented  # columns carry COMMENTs for BI tools


def test_bi_views_migration_downgrades_and_upgrades(fresh_pg_url: str, tmp_path: Path) -> None:
    # Its own database: a downgrade would take the views away from the shared one.
    settings = Settings(data_dir=tmp_path / "data", database_url=fresh_pg_url)
    SessionStore.from_settings(settings).close()  # opens (and checks) the schema
    url = settings.resolved_database_url
    engine = make_engine(url, pool_size=1)

    def views() -> set[str]:
        with engine.connect() as conn:
            return set(
                conn.execute(text("SELECT viewname FROM pg_views WHERE viewname LIKE 'bi_%'"))
                .scalars()
                .all()
            )

    try:
        assert views() == {"bi_events", "bi_messages", "bi_tool_calls", "bi_sessions"}
        migrate.downgrade(url, "0001")
        assert views() == set()
        migrate.upgrade(url)
        assert len(views()) == 4
    finally:
        engine.dispose()


def test_state_and_export_refuse_a_negative_seq_and_one_past_the_head_as_rehydrate_does(
    store: SessionStore, tmp_path: Path
) -> None:
    session = store.create_session(tenant_id="acme")
    store.append(session.id, [{"type": "custom", "n": 1}, {"type": "custom", "n": 2}])
    assert store.state(session.id, at_seq=2).seq == 2
    # past the head: refused like export and fork (it was clamped to the head, so a seq
    # mistyped or of another session showed the head as if it were that point)
    for at_seq in (-1, True, "1", 3):
        with pytest.raises(InvalidEvent, match="at_seq"):
            store.state(session.id, at_seq=at_seq)
    with (tmp_path / "out.jsonl").open("w") as out, pytest.raises(InvalidEvent, match="at_seq"):
        store.export_session(session.id, out, at_seq=3)
