"""Analytics count each event once across a fork tree (issue 18, item 7): the events a fork
copied are marked ``inherited``; ``sessionstore stats`` (the real executable) and the BI
views leave them out by default and count them per session with ``--include-inherited``;
huge token totals never overflow; migration 0008 backfills existing forks."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from sqlalchemy import text

from core import SessionStore, Settings, migrate
from core.db import make_engine
from tests.acceptance.test_cli_query import _env
from tests.cli_process import run_cli
from tests.contract import test_analytics
from tests.contract.test_projection import SessionBuilder
from tests.integration import test_migrations

# shared fixtures: a migrated PostgreSQL store; an unmigrated database of either backend
pg_store = test_analytics.pg_store
empty_url = test_migrations.empty_url


def _stats(settings: Settings, *args: str) -> dict[str, Any]:
    done = run_cli("stats", "--json", *args, env=_env(settings), timeout=60)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = orjson.loads(done.stdout)
    return result


def _fork_tree(store: SessionStore) -> tuple[str, str, str]:
    """parent: 2 turns (input 100 each); fork at seq 4 adds a turn with input 1000; a fork
    of the fork (at its head) adds a turn with input 10000."""
    parent = store.create_session(tenant_id="acme")
    b = SessionBuilder()
    for i in range(2):
        b.user(f"task {i}")
        b.assistant(f"done {i}", usage=(100, 1))
    store.append(parent.id, b.events)
    fork = store.fork(parent.id)
    fb = SessionBuilder("f")
    fb.user("more")
    fb.assistant("more done", usage=(1000, 1))
    store.append(fork.id, fb.events)
    grandchild = store.fork(fork.id)
    gb = SessionBuilder("g")
    gb.user("even more")
    gb.assistant("even more done", usage=(10000, 1))
    store.append(grandchild.id, gb.events)
    return parent.id, fork.id, grandchild.id


def test_copied_events_are_marked_inherited(store: SessionStore) -> None:
    parent, fork, grandchild = _fork_tree(store)
    with store.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT session_id, seq, inherited FROM events ORDER BY position")
        ).all()
    marked = {(s, seq): bool(i) for s, seq, i in rows}
    assert [marked[(parent, q)] for q in range(1, 5)] == [False] * 4
    assert [marked[(fork, q)] for q in range(1, 7)] == [True] * 4 + [False] * 2
    assert [marked[(grandchild, q)] for q in range(1, 9)] == [True] * 6 + [False] * 2


def test_stats_count_each_event_once_unless_include_inherited(
    store: SessionStore, settings: Settings
) -> None:
    parent, fork, grandchild = _fork_tree(store)

    once = _stats(settings)
    assert once["events"] == 4 + 2 + 2
    assert once["tokens"]["input"] == 100 * 2 + 1000 + 10000
    assert once["tokens"]["output"] == 4
    assert once["inherited_events"] == 4 + 6 and once["include_inherited"] is False
    assert once["events_by_type"] == {"message": 8}
    assert sum(d["events"] for d in once["events_by_day"]) == 8
    by_session = {s["session_id"]: s["events"] for s in once["top_sessions_by_events"]}
    assert by_session == {parent: 4, fork: 2, grandchild: 2}
    assert once["tokens"]["cost"] == pytest.approx(0.375 * 4)

    per_session = _stats(settings, "--include-inherited")
    assert per_session["events"] == 4 + 6 + 8
    assert per_session["tokens"]["input"] == 200 + (200 + 1000) + (200 + 1000 + 10000)
    assert per_session["inherited_events"] == 10 and per_session["include_inherited"] is True
    by_session = {s["session_id"]: s["events"] for s in per_session["top_sessions_by_events"]}
    assert by_session == {parent: 4, fork: 6, grandchild: 8}

    # the library says the same
    assert store.stats().tokens.input == 11200
    assert store.stats(include_inherited=True).tokens.input == 12600

    # and the table output names the inherited events
    done = run_cli("stats", env=_env(settings), timeout=60)
    assert done.returncode == 0, done.stderr
    assert "inherited by forks" in done.stdout and "not counted" in done.stdout


# (parent index, fork point as a fraction of its head, tokens of each own message)
_TREES = st.lists(
    st.tuples(st.integers(0, 50), st.floats(0, 1), st.lists(st.integers(0, 10**6), max_size=3)),
    min_size=1,
    max_size=5,
)


@hsettings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(tree=_TREES, root=st.lists(st.integers(0, 10**6), max_size=3))
def test_any_fork_tree_counts_each_message_once(
    store: SessionStore, tree: list[tuple[int, float, list[int]]], root: list[int]
) -> None:
    """Forks of forks at any point, with appends after: by default the tokens are those of
    the messages ever appended; per session, those of every session's whole history."""
    tenant = f"t{uuid.uuid4().hex[:8]}"
    histories: list[list[int]] = []  # per session: the tokens of its messages, in seq order
    ids: list[str] = []

    def append(index: int, tokens: list[int]) -> None:
        if tokens:
            b = SessionBuilder()
            for n in tokens:
                b.assistant("x", usage=(n, 0))
            store.append(ids[index], b.events)
            histories[index].extend(tokens)

    ids.append(store.create_session(tenant_id=tenant).id)
    histories.append([])
    append(0, root)
    for parent, fraction, tokens in tree:
        parent %= len(ids)
        point = int(fraction * len(histories[parent]))
        ids.append(store.fork(ids[parent], at_seq=point).id)
        histories.append(histories[parent][:point])
        append(len(ids) - 1, tokens)

    appended = sum(root) + sum(sum(t) for _, _, t in tree)
    once = store.stats(tenant_id=tenant)
    per_session = store.stats(tenant_id=tenant, include_inherited=True)
    assert once.tokens.input == appended
    assert once.events == len(root) + sum(len(t) for _, _, t in tree)
    assert per_session.tokens.input == sum(sum(h) for h in histories)
    assert per_session.events == sum(len(h) for h in histories)
    assert once.inherited_events == per_session.inherited_events == per_session.events - once.events


HUGE = 2**62  # inside int64, as writes require; four of these sum past it


@pytest.mark.parametrize("as_json", [True, False])
def test_stats_survive_huge_token_totals(
    store: SessionStore, settings: Settings, as_json: bool
) -> None:
    session = store.create_session(tenant_id="acme")
    b = SessionBuilder()
    for _ in range(4):
        b.assistant("big", usage=(HUGE, 1))
    store.append(session.id, b.events)
    fork = store.fork(session.id)  # the inherited copies must not overflow either

    for extra in ([], ["--include-inherited"]):
        done = run_cli(
            "stats", *extra, *(["--json"] if as_json else []), env=_env(settings), timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        if not as_json:
            assert "total tokens" in done.stdout
            continue
        data = orjson.loads(done.stdout)
        # a sum past int64 saturates (with a warning) on both backends
        assert data["tokens"]["input"] == pytest.approx(2**63 - 1)
        assert data["tokens"]["output"] == (8 if extra else 4)
        assert [u["responses"] for u in data["usage_by_day"]] == [8 if extra else 4]
    assert fork.id


# PostgreSQL: the BI views ---------------------------------------------------------------


def test_bi_views_mark_inherited_rows_and_count_tokens_once(pg_store: SessionStore) -> None:
    parent, fork, grandchild = _fork_tree(pg_store)
    with pg_store.engine.connect() as conn:

        def scalar(sql: str) -> Any:
            return conn.execute(text(sql)).scalar_one()

        assert scalar("SELECT sum(input_tokens) FROM bi_messages WHERE NOT inherited") == 11200
        assert scalar("SELECT sum(input_tokens) FROM bi_messages") == 12600
        assert scalar("SELECT count(*) FROM bi_events WHERE inherited") == 10
        assert scalar("SELECT count(*) FROM bi_events WHERE NOT inherited") == 8
        assert scalar("SELECT sum(input_tokens) FROM bi_sessions") == 11200
        assert scalar("SELECT count(*) FROM bi_tool_calls") == 0
        sessions = {
            r.session_id: r
            for r in conn.execute(
                text("SELECT session_id, events, inherited_events, messages FROM bi_sessions")
            )
        }
        assert scalar("SELECT col_description('bi_messages'::regclass, 5)")  # documented
    assert (sessions[parent].inherited_events, sessions[parent].messages) == (0, 4)
    assert (sessions[fork].events, sessions[fork].inherited_events) == (6, 4)
    assert (sessions[fork].messages, sessions[grandchild].inherited_events) == (2, 6)


def test_bi_tool_calls_carry_inherited(pg_store: SessionStore) -> None:
    session = pg_store.create_session(tenant_id="acme")
    b = SessionBuilder()
    _, (call,) = b.assistant("ls", tools=[("bash", {"command": "ls"})])
    b.tool_result(call, "bash", "a.txt")
    pg_store.append(session.id, b.events)
    fork = pg_store.fork(session.id)
    with pg_store.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT session_id, inherited, result_seq FROM bi_tool_calls ORDER BY position")
        ).all()
    assert rows == [(session.id, False, 2), (fork.id, True, 2)]


# migration 0008 -------------------------------------------------------------------------


def _message(input_tokens: int) -> str:
    usage = {"input": input_tokens, "output": 1}
    return orjson.dumps(
        {"type": "message", "message": {"role": "assistant", "content": "x", "usage": usage}}
    ).decode()


def _seed_pre_0008(url: str) -> None:
    """What a 0012 database holds after a fork: the fork's rows 1..forked_from_seq are
    copies (written by copy_events before 0008, so unmarked)."""
    now = datetime.now(UTC)
    engine = make_engine(url, pool_size=1)
    sessions = [("p", None, None, 3), ("f", "p", 2, 3), ("g", "f", 3, 4), ("lone", None, None, 1)]
    events = [("p", 1, 1), ("p", 2, 10), ("p", 3, 100)]
    events += [("f", 1, 1), ("f", 2, 10), ("f", 3, 1000)]
    events += [("g", 1, 1), ("g", 2, 10), ("g", 3, 1000), ("g", 4, 10000), ("lone", 1, 5)]
    try:
        with engine.begin() as conn:
            for sid, parent, at, head in sessions:
                conn.execute(
                    text(
                        "INSERT INTO sessions (id, tenant_id, parent_id, forked_from_seq, "
                        "head_seq, created_at, updated_at) "
                        "VALUES (:id, 'acme', :parent, :at, :head, :now, :now)"
                    ),
                    {"id": sid, "parent": parent, "at": at, "head": head, "now": now},
                )
            for sid, seq, tokens in events:
                conn.execute(
                    text(
                        "INSERT INTO events (session_id, seq, type, payload, recorded_at) "
                        "VALUES (:sid, :seq, 'message', :payload, :now)"
                    ),
                    {"sid": sid, "seq": seq, "payload": _message(tokens), "now": now},
                )
    finally:
        engine.dispose()


def _inherited(url: str) -> dict[tuple[str, int], bool]:
    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT session_id, seq, inherited FROM events")).all()
    finally:
        engine.dispose()
    return {(s, q): bool(i) for s, q, i in rows}


def _columns(url: str) -> set[str]:
    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            if url.startswith("sqlite"):
                rows = conn.execute(text("PRAGMA table_info(events)")).all()
                return {r[1] for r in rows}
            return set(
                conn.execute(
                    text(
                        "SELECT column_name FROM information_schema.columns "
                        "WHERE table_name = 'events'"
                    )
                ).scalars()
            )
    finally:
        engine.dispose()


def test_migration_0008_backfills_forks_and_round_trips(empty_url: str, tmp_path: Path) -> None:
    migrate.upgrade(empty_url, "0012")
    _seed_pre_0008(empty_url)
    migrate.upgrade(empty_url)

    inherited = _inherited(empty_url)
    assert {k for k, v in inherited.items() if v} == {
        ("f", 1),
        ("f", 2),
        ("g", 1),
        ("g", 2),
        ("g", 3),
    }
    settings = Settings(data_dir=tmp_path / "data", database_url=empty_url)
    with SessionStore.from_settings(settings) as store:
        assert store.stats().tokens.input == 1 + 10 + 100 + 1000 + 10000 + 5
        assert store.stats(include_inherited=True).tokens.input == 111 + 1011 + 11011 + 5
        assert store.stats().inherited_events == 5
        if not empty_url.startswith("sqlite"):
            with store.engine.connect() as conn:
                total = conn.execute(
                    text("SELECT sum(input_tokens) FROM bi_messages WHERE NOT inherited")
                ).scalar_one()
                own = conn.execute(text("SELECT sum(input_tokens) FROM bi_sessions")).scalar_one()
            assert total == own == 11116

    migrate.downgrade(empty_url, "0012")
    assert "inherited" not in _columns(empty_url)
    if not empty_url.startswith("sqlite"):
        engine = make_engine(empty_url, pool_size=1)
        try:
            with engine.connect() as conn:
                assert conn.execute(text("SELECT count(*) FROM bi_messages")).scalar_one() == 11
                sums = conn.execute(text("SELECT sum(input_tokens) FROM bi_sessions")).scalar()
                assert sums == 111 + 1011 + 11011 + 5  # 0009's views: per session again
        finally:
            engine.dispose()

    migrate.upgrade(empty_url)
    assert sum(_inherited(empty_url).values()) == 5
    # positions are still never reused after the round trip (SQLite keeps AUTOINCREMENT)
    if empty_url.startswith("sqlite"):
        engine = make_engine(empty_url, pool_size=1)
        try:
            with engine.connect() as conn:
                ddl = conn.execute(
                    text("SELECT sql FROM sqlite_master WHERE name = 'events'")
                ).scalar_one()
        finally:
            engine.dispose()
        assert "AUTOINCREMENT" in ddl.upper()
