"""Migration 0009 (events.payload jsonb -> json) keeps existing events, views and reads."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import text

from core import SessionStore, Settings, migrate
from core.db import make_engine
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

    migrate.downgrade(fresh_pg_url, "0004")
    # from_settings refuses a schema behind the code: look at the downgraded one directly
    with SessionStore(settings, make_engine(fresh_pg_url)) as store:
        assert _payload_type(store) == "jsonb"
        with store.engine.connect() as conn:
            count = conn.execute(text("SELECT count(*) FROM bi_events")).scalar_one()
        assert count == 2
