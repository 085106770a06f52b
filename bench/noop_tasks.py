"""Bench-only Celery tasks, loaded into the benchmark's worker with ``-I bench.noop_tasks``.

Both take the same arguments as ``sessionstore.append`` and return a result of about the same
size (same broker, same result backend, same serializer, same worker settings):

- ``bench.noop`` touches no database: the Celery floor;
- ``bench.raw_insert`` adds the physical floor of the write itself, psycopg ``executemany``
  of the events into the jsonb table of ``bench.peers``' raw floor, in one transaction: the
  floor of a queue that must commit what it carries.
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from bench.peers.drivers.raw import TABLE, _dumps
from tasks.app import sessionstore_task

NOOP_TASK = "bench.noop"
RAW_INSERT_TASK = "bench.raw_insert"
_conn: list[psycopg.Connection[Any]] = []  # one per pool process, opened on first use


@sessionstore_task(name=NOOP_TASK)
def noop(
    session_id: str,
    events: list[Any],
    expected_seq: int | None = None,
    idempotency_key: str | None = None,
) -> dict[str, Any]:
    n = len(events)
    return {
        "status": "ok",
        "session_id": session_id,
        "first_seq": 1,
        "last_seq": n,
        "positions": list(range(1, n + 1)),
        "replayed": False,
    }


def _connection() -> psycopg.Connection[Any]:
    if not _conn:
        url = os.environ["SESSIONSTORE_DATABASE_URL"].replace("+psycopg", "", 1)
        conn = psycopg.connect(url)
        conn.execute(TABLE)
        conn.commit()
        _conn.append(conn)
    return _conn[0]


@sessionstore_task(name=RAW_INSERT_TASK)
def raw_insert(
    session_id: str,
    events: list[Any],
    expected_seq: int | None = None,
    idempotency_key: str | None = None,
) -> dict[str, Any]:
    conn = _connection()
    # The floor's table (bench.peers' raw floor, unique (session_id, seq)), keyed by the
    # write's own key so that every write's 1..n is new: the floor does no sequencing.
    key = idempotency_key or session_id
    rows = [
        (key, i, str(e.get("type", "")), Jsonb(e, dumps=_dumps)) for i, e in enumerate(events, 1)
    ]
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO raw_events (session_id, seq, type, payload) VALUES (%s, %s, %s, %s)",
            rows,
        )
    conn.commit()
    result: dict[str, Any] = noop(session_id, events, expected_seq, idempotency_key)
    return result
