"""This project: ``SessionStore`` on PostgreSQL (the library path, blobs on local disk).

With a last argument ``lz4`` the journal's payload column compresses with lz4 instead of
PostgreSQL's default pglz (set after the migrations; not what the migrations create): the
storage-against-write-time trade the peers run measures beside the default.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.peers.drivers.common import SESSION, main
from core import SessionStore, Settings
from core.errors import SessionNotFound
from core.migrate import upgrade


class Ours:
    def __init__(self, dsn: str, workdir: str, *, compression: str | None = None) -> None:
        url = dsn.replace("postgresql://", "postgresql+psycopg://", 1)
        blobs = Path(workdir) / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        upgrade(url)
        if compression is not None:
            import psycopg

            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(
                    f"ALTER TABLE events ALTER COLUMN payload SET COMPRESSION {compression}"
                )
        self.store = SessionStore.from_settings(
            Settings(database_url=url, data_dir=Path(workdir), blob_url=blobs.as_uri())
        )
        try:
            self.store.get_session(SESSION)
        except SessionNotFound:
            self.store.journal.create_session(tenant_id="bench", session_id=SESSION)

    def append(self, events: Sequence[dict[str, Any]]) -> None:
        self.store.append(SESSION, events)

    def read(self) -> list[dict[str, Any]]:
        return [e.payload for e in self.store.read(SESSION, rehydrate=True)]

    def close(self) -> None:
        self.store.close()


if __name__ == "__main__":
    COMPRESSION = sys.argv.pop() if sys.argv[-1] == "lz4" else None
    main(lambda dsn, workdir: Ours(dsn, workdir, compression=COMPRESSION))
