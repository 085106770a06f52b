"""Alembic is the only schema source: head equals the models, and migrations round-trip."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from core import migrate
from core.db import make_engine
from core.models import metadata
from tests.conftest import PG_ADMIN_DSN, drop_pg_database, pg_url_for


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    request.getfixturevalue("pg_template")  # skips or fails like every PostgreSQL test
    name = f"ss_m_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield pg_url_for(name)
    drop_pg_database(name)


def _diff(url: str) -> list[object]:
    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(ctx, metadata))
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = make_engine(url, pool_size=1)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_head_on_an_empty_database_equals_the_models(empty_url: str) -> None:
    migrate.upgrade(empty_url)
    assert _diff(empty_url) == []
    assert migrate.is_current(empty_url)


def test_upgrade_downgrade_upgrade_round_trip(empty_url: str) -> None:
    migrate.upgrade(empty_url)
    assert _tables(empty_url) == set(metadata.tables)
    migrate.downgrade(empty_url, "base")
    assert _tables(empty_url) == set()
    assert migrate.current_revision(empty_url) is None
    migrate.upgrade(empty_url)
    assert _diff(empty_url) == [] and migrate.is_current(empty_url)
