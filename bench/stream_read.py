"""The session read: whole result, streamed in chunks, row by row, and the server alone.

    python -m bench.stream_read [--rounds 15]

Two tables, each in a fresh database: the 200-turn session of ``bench.peers`` appended
through ``SessionStore`` (1,010 events, payloads with refs, 4.2 MB of JSON text, 61% of it
TOASTed), and 100,000 small JSON rows (~250 bytes). Per round, interleaved, each variant reads
the whole table in seq order on one open connection with the project's JSON loader:

- ``fetchall``: ``execute`` + ``fetchall`` (the session read before 6b66984);
- ``stream-N``: ``cursor.stream(size=N)``: libpq's chunked rows mode (N > 1, libpq >= 17)
  or single-row mode (N = 1), rows decoded as each chunk arrives;
- ``server``: the same scan with ``octet_length(payload::text)`` instead of the payload:
  the detoasting without the transfer or the decoding (the floor of any client).

Prints medians (min-max) in ms and each variant's ratio to ``fetchall``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import set_json_loads

from bench.peers.workload import session, split
from bench.pgdb import dsn, scratch_database, url
from core import SessionStore, Settings
from core.exact_json import loads

_QUERY = "SELECT seq, payload FROM {table} ORDER BY seq"
_SERVER = "SELECT seq, octet_length(payload::text) FROM {table} ORDER BY seq"


def _load_session(name: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(database_url=url(name), data_dir=Path(tmp))
        with SessionStore.from_settings(settings) as store:
            sid = store.create_session(tenant_id="bench").id
            events = split(session())[0]
            for i in range(0, len(events), 100):
                store.append(sid, events[i : i + 100])


def _variants(conn: psycopg.Connection[Any], table: str) -> dict[str, Callable[[], int]]:
    query, server = _QUERY.format(table=table), _SERVER.format(table=table)

    def fetchall() -> int:
        with conn.cursor(binary=True) as cur:
            return len(cur.execute(query).fetchall())

    def stream(size: int) -> Callable[[], int]:
        def read() -> int:
            with conn.cursor(binary=True) as cur:
                return len(list(cur.stream(query, size=size)))

        return read

    def server_only() -> int:
        with conn.cursor(binary=True) as cur:
            return len(cur.execute(server).fetchall())

    return {
        "fetchall": fetchall,
        "stream-1": stream(1),
        "stream-64": stream(64),
        "stream-512": stream(512),
        "server": server_only,
    }


def _measure(name: str, table: str, rounds: int, label: str) -> None:
    with psycopg.connect(dsn(name), autocommit=True) as conn:
        set_json_loads(loads, conn)
        variants = _variants(conn, table)
        times: dict[str, list[float]] = {k: [] for k in variants}
        rows = {k: f() for k, f in variants.items()}  # warm-up, and every variant sees all
        assert len(set(rows.values())) == 1, rows
        for _ in range(rounds):
            for key, read in variants.items():
                started = time.perf_counter()
                read()
                times[key].append((time.perf_counter() - started) * 1e3)
    base = statistics.median(times["fetchall"])
    print(f"\n{label}: {rows['fetchall']:,} rows, medians of {rounds} interleaved rounds")
    print(f"{'variant':12s} {'ms':>8s} {'min-max':>15s} {'x fetchall':>11s}")
    for key, values in times.items():
        median = statistics.median(values)
        spread = f"{min(values):.1f}-{max(values):.1f}"
        print(f"{key:12s} {median:8.1f} {spread:>15s} {median / base:10.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(f"libpq {psycopg.pq.version()}, chunked: {psycopg.capabilities.has_stream_chunked()}")
    with scratch_database("ss_stream", migrate=True) as name:
        _load_session(name)
        _measure(name, "events", args.rounds, "200-turn session (bench.peers workload)")
    with scratch_database("ss_stream") as name:
        with psycopg.connect(dsn(name), autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE small AS SELECT g AS seq, json_build_object('type', 'message', "
                "'id', g::text, 'content', repeat('x', 200)) AS payload "
                "FROM generate_series(1, 100000) AS g"
            )
        _measure(name, "small", max(3, args.rounds // 3), "100,000 small rows")


if __name__ == "__main__":
    main()
