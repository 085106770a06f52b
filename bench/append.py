"""Append throughput and latency vs the physical limit, side by side in one run.

    python bench/append.py [--repeats 3] [--events 3000]

PostgreSQL: SessionStore.append in batches of 1, 10 and 100 vs raw psycopg ``executemany``
(one transaction per batch) and ``COPY`` into an identically shaped table; single-event p50
latency vs a raw single-row INSERT + COMMIT. SQLite: SessionStore.append vs raw sqlite3.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import psycopg

from core import SessionStore, Settings
from core.migrate import upgrade

ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
RAW_PG = """
CREATE TABLE raw_events (
    position BIGSERIAL PRIMARY KEY,
    session_id VARCHAR(36) NOT NULL REFERENCES sessions(id),
    seq BIGINT NOT NULL,
    type VARCHAR(256) NOT NULL,
    payload JSONB NOT NULL,
    recorded_at TIMESTAMPTZ NOT NULL,
    UNIQUE (session_id, seq)
);
CREATE INDEX ON raw_events (type, recorded_at);
CREATE INDEX ON raw_events (recorded_at);
"""
RAW_SQLITE = """
CREATE TABLE raw_events (
    position INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id VARCHAR(36) NOT NULL REFERENCES sessions(id),
    seq BIGINT NOT NULL,
    type VARCHAR(256) NOT NULL,
    payload JSON NOT NULL,
    recorded_at DATETIME NOT NULL,
    UNIQUE (session_id, seq)
);
CREATE INDEX raw_type ON raw_events (type, recorded_at);
CREATE INDEX raw_rec ON raw_events (recorded_at);
"""


def event(i: int) -> dict[str, Any]:
    """A ~1 KB assistant message in the pi entry format."""
    return {
        "type": "message",
        "id": f"{i:08x}",
        "parentId": f"{i - 1:08x}" if i else None,
        "timestamp": "2026-11-21T12:00:00.000Z",
        "message": {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Let me look at the failing test first. " * 4},
                {"type": "text", "text": "I'll run the test suite and read the traceback. " * 8},
                {
                    "type": "toolCall",
                    "id": f"call_{i}",
                    "name": "bash",
                    "arguments": {"command": "pytest -x tests/test_journal.py"},
                },
            ],
            "usage": {"input": 1200, "output": 310, "cacheRead": 0, "totalTokens": 1510},
            "model": "claude-sonnet",
        },
    }


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_rate(n_events: int, runs: list[float]) -> float:
    return n_events / statistics.median(runs)


def bench_store(store: SessionStore, batch: int, n: int) -> float:
    sid = store.create_session(tenant_id="bench").id
    batches = [[event(i + j) for j in range(batch)] for i in range(0, n, batch)]
    return timed(lambda: [store.append(sid, b) for b in batches])


def store_latencies(store: SessionStore, n: int) -> list[float]:
    sid = store.create_session(tenant_id="bench").id
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        store.append(sid, [event(i)])
        out.append(time.perf_counter() - t0)
    return out


def pg_raw_session(conn: psycopg.Connection[Any]) -> str:
    sid = str(uuid.uuid4())
    now = datetime.now(UTC)
    conn.execute(
        "INSERT INTO sessions (id, tenant_id, head_seq, created_at, updated_at) "
        "VALUES (%s, 'bench', 0, %s, %s)",
        (sid, now, now),
    )
    conn.commit()
    return sid


def pg_raw_executemany(conn: psycopg.Connection[Any], batch: int, n: int) -> float:
    sid = pg_raw_session(conn)
    now = datetime.now(UTC)

    def run() -> None:
        with conn.cursor() as cur:
            for start in range(0, n, batch):
                rows = [
                    (sid, i + 1, "message", orjson.dumps(event(i)).decode(), now)
                    for i in range(start, start + batch)
                ]
                cur.executemany(
                    "INSERT INTO raw_events (session_id, seq, type, payload, recorded_at) "
                    "VALUES (%s, %s, %s, %s, %s)",
                    rows,
                )
                conn.commit()

    return timed(run)


def pg_raw_copy(conn: psycopg.Connection[Any], batch: int, n: int) -> float:
    sid = pg_raw_session(conn)
    now = datetime.now(UTC)

    def run() -> None:
        with conn.cursor() as cur:
            for start in range(0, n, batch):
                with cur.copy(
                    "COPY raw_events (session_id, seq, type, payload, recorded_at) FROM STDIN"
                ) as copy:
                    for i in range(start, start + batch):
                        copy.write_row(
                            (sid, i + 1, "message", orjson.dumps(event(i)).decode(), now)
                        )
                conn.commit()

    return timed(run)


def pg_raw_latencies(conn: psycopg.Connection[Any], n: int) -> list[float]:
    sid = pg_raw_session(conn)
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        conn.execute(
            "INSERT INTO raw_events (session_id, seq, type, payload, recorded_at) "
            "VALUES (%s, %s, %s, %s, %s)",
            (sid, i + 1, "message", orjson.dumps(event(i)).decode(), datetime.now(UTC)),
        )
        conn.commit()
        out.append(time.perf_counter() - t0)
    return out


def sqlite_raw_executemany(path: Path, batch: int, n: int) -> float:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    sid = str(uuid.uuid4())
    now = datetime.now(UTC).isoformat()
    conn.execute(
        "INSERT INTO sessions (id, tenant_id, head_seq, created_at, updated_at) "
        "VALUES (?, 'bench', 0, ?, ?)",
        (sid, now, now),
    )

    def run() -> None:
        for start in range(0, n, batch):
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT INTO raw_events (session_id, seq, type, payload, recorded_at) "
                "VALUES (?, ?, ?, ?, ?)",
                [
                    (sid, i + 1, "message", orjson.dumps(event(i)).decode(), now)
                    for i in range(start, start + batch)
                ],
            )
            conn.execute("COMMIT")

    elapsed = timed(run)
    conn.close()
    return elapsed


def scaled(batch: int, n: int) -> int:
    """Fewer events for batch 1 (each is a commit) so every run takes similar time."""
    return max(batch * 10, n if batch >= 10 else n // 3)


def run_postgres(repeats: int, n: int) -> list[str]:
    name = f"ss_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    lines = []
    try:
        upgrade(url)
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{name}") as conn:
            conn.execute(RAW_PG)
            conn.commit()
            with SessionStore.from_settings(Settings(database_url=url)) as store:
                for batch in (1, 10, 100):
                    m = scaled(batch, n)
                    ours = median_rate(m, [bench_store(store, batch, m) for _ in range(repeats)])
                    raw = median_rate(
                        m, [pg_raw_executemany(conn, batch, m) for _ in range(repeats)]
                    )
                    cp = median_rate(m, [pg_raw_copy(conn, batch, m) for _ in range(repeats)])
                    lines.append(
                        f"| PostgreSQL | {batch} | {ours:,.0f} | {raw:,.0f} | {cp:,.0f} "
                        f"| {ours / raw:.2f}x | {ours / cp:.2f}x |"
                    )
                    print(lines[-1], flush=True)
                ours_lat = statistics.median(store_latencies(store, 500))
                raw_lat = statistics.median(pg_raw_latencies(conn, 500))
                lines.append(
                    f"\nsingle-event p50 latency (PostgreSQL): append {ours_lat * 1e3:.2f} ms, "
                    f"raw INSERT+COMMIT {raw_lat * 1e3:.2f} ms, ratio {ours_lat / raw_lat:.2f}x "
                    "(target <= 2x)"
                )
                print(lines[-1], flush=True)
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return lines


def run_sqlite(repeats: int, n: int) -> list[str]:
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.db"
        url = f"sqlite:///{path}"
        upgrade(url)
        with sqlite3.connect(path) as conn:
            conn.executescript(RAW_SQLITE)
        with SessionStore.from_settings(Settings(database_url=url, data_dir=Path(tmp))) as store:
            for batch in (1, 10, 100):
                m = scaled(batch, n)
                ours = median_rate(m, [bench_store(store, batch, m) for _ in range(repeats)])
                raw = median_rate(
                    m, [sqlite_raw_executemany(path, batch, m) for _ in range(repeats)]
                )
                ratio = ours / raw
                lines.append(
                    f"| SQLite | {batch} | {ours:,.0f} | {raw:,.0f} | n/a | {ratio:.2f}x | n/a |"
                )
                print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--events", type=int, default=3000)
    args = parser.parse_args()
    header = (
        "| backend | batch | append ev/s | raw executemany ev/s | raw COPY ev/s "
        "| vs executemany | vs COPY |\n|---|---|---|---|---|---|---|"
    )
    print(header)
    run_postgres(args.repeats, args.events)
    run_sqlite(args.repeats, args.events)


if __name__ == "__main__":
    main()
