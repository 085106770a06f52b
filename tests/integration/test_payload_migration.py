"""Migration 0009 (events.payload jsonb -> json) keeps existing events, views and reads."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import text

from core import SessionStore, Settings, exact_json, migrate
from core.db import make_engine
from core.errors import DowngradeRefused
from core.query.state import state_from_events
from tests.conftest import PG_ADMIN_DSN, drop_pg_database, pg_url_for

EVENT = {"type": "message", "id": "e1", "message": {"role": "user", "content": "hi"}}


@pytest.fixture
def fresh_pg_url(pg_template: str) -> Iterator[str]:
    name = f"ss_m9_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield pg_url_for(name)
    drop_pg_database(name)


def _payload_type(store: SessionStore) -> str:
    with store.engine.connect() as conn:
        return str(
            conn.execute(
                text(
                    "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
                    "WHERE attrelid = 'events'::regclass AND attname = 'payload'"
                )
            ).scalar_one()
        )


def test_existing_jsonb_events_survive_the_upgrade_and_the_downgrade(
    fresh_pg_url: str, tmp_path: Path
) -> None:
    migrate.upgrade(fresh_pg_url, "0004")
    dsn = fresh_pg_url.replace("postgresql+psycopg://", "postgresql://")
    now = datetime.now(UTC)
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO sessions (id, tenant_id, head_seq, created_at, updated_at) "
            "VALUES ('s1', 'acme', 1, %s, %s)",
            (now, now),
        )
        conn.execute(
            "INSERT INTO events (session_id, seq, type, payload, recorded_at) "
            "VALUES ('s1', 1, 'message', %s::jsonb, %s)",
            (psycopg.types.json.Json(EVENT), now),
        )
    migrate.upgrade(fresh_pg_url)
    settings = Settings(database_url=fresh_pg_url, data_dir=tmp_path)
    with SessionStore.from_settings(settings) as store:
        assert _payload_type(store) == "json"
        [event] = store.read("s1")
        assert event.payload == EVENT
        store.append("s1", [{"type": "custom", "b": -0.0, "a": 1e16}])
        with store.engine.connect() as conn:
            roles = conn.execute(text("SELECT role, text FROM bi_messages")).all()
        assert roles == [("user", "hi")]

    migrate.downgrade(fresh_pg_url, "0004", force=True)  # jsonb again: it holds events
    # from_settings refuses a schema behind the code: look at the downgraded one directly
    with SessionStore(settings, make_engine(fresh_pg_url)) as store:
        assert _payload_type(store) == "jsonb"
        with store.engine.connect() as conn:
            count = conn.execute(text("SELECT count(*) FROM bi_events")).scalar_one()
        assert count == 2


def _rows(store: SessionStore, sql: str) -> list[object]:
    with store.engine.connect() as conn:
        return list(conn.execute(text(sql)).all())


def test_a_downgrade_to_jsonb_is_refused_unless_forced_and_forced_drops_the_snapshots(
    fresh_pg_url: str, tmp_path: Path
) -> None:
    """Below 0009 the payloads go back to jsonb (key order, -0.0 and 1e16 lost for good),
    and the snapshots folded from the exact text survived it: state from a snapshot then
    differed from state from scratch (invariant 11). Refused, changing nothing; forced, the
    snapshots go with the exact text."""
    migrate.upgrade(fresh_pg_url)
    settings = Settings(database_url=fresh_pg_url, data_dir=tmp_path, snapshot_every=1)
    event = {"type": "compaction", "id": "c", "parentId": None, "summary": "s",
             "tokensBefore": 1e16, "zeta": {"z": 1, "a": -0.0}}  # fmt: skip
    with SessionStore.from_settings(settings) as store:
        session = store.create_session(tenant_id="acme")
        store.append(session.id, [event])
        stale = store.state(session.id)  # folds and keeps the snapshot at seq 1
        before = _rows(store, "SELECT session_id, seq, payload::text FROM events")
        snapshots = _rows(store, "SELECT session_id, seq FROM snapshots")
        assert snapshots == [(session.id, 1)]

        with pytest.raises(DowngradeRefused, match=r"past 0009.*1 event.*--force") as refused:
            migrate.downgrade(fresh_pg_url, "0006")
        assert refused.value.revision == "0009"
        assert migrate.current_revision(fresh_pg_url) == migrate.HEAD_REVISION
        assert _payload_type(store) == "json"
        assert _rows(store, "SELECT session_id, seq, payload::text FROM events") == before
        assert _rows(store, "SELECT session_id, seq FROM snapshots") == snapshots
        assert exact_json.dumps(store.read(session.id)[0].payload) == exact_json.dumps(event)

    migrate.downgrade(fresh_pg_url, "0006", force=True)
    assert migrate.current_revision(fresh_pg_url) == "0006"
    migrate.upgrade(fresh_pg_url)
    with SessionStore.from_settings(settings) as store:
        left = _rows(store, "SELECT session_id, seq FROM snapshots")
        events = store.read(session.id)
        from_scratch = state_from_events(events, session=store.get_session(session.id))
        folded = store.state(session.id)  # from the snapshot, had it survived the downgrade
        # jsonb kept 1e16 as the integer 10000000000000000: what the snapshot held is not
        # what the events hold now, so the state says where it came from
        assert stale.compaction is not None and from_scratch.compaction is not None
        assert repr(stale.compaction.tokens_before) == "1e+16"
        assert repr(from_scratch.compaction.tokens_before) == "10000000000000000"
        assert folded.compaction is not None
        assert repr(folded.compaction.tokens_before) == repr(from_scratch.compaction.tokens_before)
        assert folded.compaction == from_scratch.compaction
        assert left == []  # why: the forced downgrade deleted it
