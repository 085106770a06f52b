"""eventsourcing: an aggregate whose events each carry one pi entry, PostgreSQL recorder.

Single append = one aggregate event saved; batch = 100 events triggered, one save.
Rebuild = ``repository.get`` (replays every event; no snapshots, as for the others).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlparse

from eventsourcing.application import AggregateNotFoundError, Application
from eventsourcing.domain import Aggregate, event

from bench.peers.drivers.common import SESSION, main


class Session(Aggregate):
    @event("Started")
    def __init__(self, key: str) -> None:
        self.entries: list[dict[str, Any]] = []

    @staticmethod
    def create_id(key: str) -> uuid.UUID:
        return uuid.UUID(key)

    @event("Appended")
    def add(self, entry: dict[str, Any]) -> None:
        self.entries.append(entry)


class Peer:
    def __init__(self, dsn: str, workdir: str) -> None:
        url = urlparse(dsn)
        os.environ.update(
            PERSISTENCE_MODULE="eventsourcing.postgres",
            POSTGRES_DBNAME=url.path.lstrip("/"),
            POSTGRES_HOST=url.hostname or "127.0.0.1",
            POSTGRES_PORT=str(url.port or 5432),
            POSTGRES_USER=url.username or "postgres",
            POSTGRES_PASSWORD=url.password or "x",
        )
        self.app = Application()
        try:
            self.session = self.app.repository.get(uuid.UUID(SESSION))
        except AggregateNotFoundError:
            self.session = Session(SESSION)
            self.app.save(self.session)

    def append(self, events: Sequence[dict[str, Any]]) -> None:
        for entry in events:
            self.session.add(entry)
        self.app.save(self.session)

    def read(self) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = self.app.repository.get(uuid.UUID(SESSION)).entries
        return entries

    def close(self) -> None:
        self.app.close()


if __name__ == "__main__":
    main(Peer)
