"""Scratch PostgreSQL databases for the benches: created fresh, always dropped."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from core.migrate import upgrade

SERVER = "postgresql://postgres@127.0.0.1:5432"


def dsn(name: str) -> str:
    """The driver-level DSN (psycopg) of a database on the bench server."""
    return f"{SERVER}/{name}"


def url(name: str) -> str:
    """The SQLAlchemy URL of a database on the bench server."""
    return dsn(name).replace("postgresql://", "postgresql+psycopg://", 1)


@contextmanager
def scratch_database(prefix: str, *, migrate: bool = False) -> Iterator[str]:
    """A new database's name (migrated to head if ``migrate``), dropped on exit."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dsn("postgres"), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        if migrate:
            upgrade(url(name))
        yield name
    finally:
        with psycopg.connect(dsn("postgres"), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
