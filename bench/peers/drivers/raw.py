"""The floor: psycopg ``executemany`` into one jsonb table, a transaction per call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import psycopg
from psycopg.types.json import Jsonb

from bench.peers.drivers.common import SESSION, main

TABLE = """
CREATE TABLE IF NOT EXISTS raw_events (
    position BIGSERIAL PRIMARY KEY,
    session_id VARCHAR(36) NOT NULL,
    seq BIGINT NOT NULL,
    type VARCHAR(256) NOT NULL,
    payload JSONB NOT NULL,
    recorded_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    UNIQUE (session_id, seq)
)
"""


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


class Raw:
    def __init__(self, dsn: str, workdir: str) -> None:
        self.conn = psycopg.connect(dsn)
        self.conn.execute(TABLE)
        self.conn.commit()
        row = self.conn.execute(
            "SELECT coalesce(max(seq), 0) FROM raw_events WHERE session_id = %s", (SESSION,)
        ).fetchone()
        self.seq = int(row[0]) if row else 0
        self.conn.commit()

    def append(self, events: Sequence[dict[str, Any]]) -> None:
        rows = []
        for event in events:
            self.seq += 1
            rows.append((SESSION, self.seq, event["type"], Jsonb(event, dumps=_dumps)))
        with self.conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO raw_events (session_id, seq, type, payload) VALUES (%s, %s, %s, %s)",
                rows,
            )
        self.conn.commit()

    def read(self) -> list[dict[str, Any]]:
        # The payload as text, parsed by the client: what a reader of the floor must do.
        rows = self.conn.execute(
            "SELECT payload::text FROM raw_events WHERE session_id = %s ORDER BY seq", (SESSION,)
        ).fetchall()
        self.conn.commit()
        return [orjson.loads(r[0]) for r in rows]

    def close(self) -> None:
        self.conn.close()


if __name__ == "__main__":
    main(Raw)
