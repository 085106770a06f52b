"""Benchmark of the entry-time read (``events --since/--until``), on both backends.

A journal of N events whose payloads carry a ``timestamp`` as agents write them (ISO text
with and without a zone, and epoch milliseconds), then, interleaved round by round:

- **floor**: the driver alone extracts every ``timestamp`` (``json_extract`` on SQLite,
  ``json_extract_path_text`` on PostgreSQL): the least any filter on it reads;
- **entry time**: the same scan computing ``core.query.entry_time.entry_us`` of every row
  (the definition's form and ranges checked, the instant in microseconds);
- **listing**: one ``list_events`` page with ``entry_since`` (time blocks summarized).

It prints medians with min-max and the per-row cost over the floor. Usage:

    python -m bench.entry_time [--events 50000] [--rounds 5] [--backends sqlite,postgres]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from bench import pgdb
from core import SessionStore, Settings
from core.migrate import upgrade
from core.models import EventRow, table_of
from core.query import EventFilter
from core.query.entry_time import entry_us

_events = table_of(EventRow)
START = datetime(2026, 1, 1, tzinfo=UTC)


def stamps(n: int) -> Iterator[Any]:
    """The entry timestamps of ``n`` events, one second apart, in the forms agents write."""
    for i in range(n):
        when = START + timedelta(seconds=i)
        form = i % 4
        if form == 0:
            yield when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"
        elif form == 1:
            yield when.astimezone(UTC).isoformat()  # +00:00
        elif form == 2:
            yield int(when.timestamp() * 1000)  # epoch ms, as pi's messages
        else:
            yield when.strftime("%Y-%m-%d %H:%M:%S")  # no zone: UTC


def fill(store: SessionStore, n: int) -> None:
    session = store.create_session(tenant_id="bench").id
    batch: list[dict[str, Any]] = []
    for i, stamp in enumerate(stamps(n)):
        batch.append({"type": "custom", "id": f"e{i}", "timestamp": stamp, "text": "x" * 80})
        if len(batch) == 1000:
            store.append(session, batch)
            batch = []
    if batch:
        store.append(session, batch)


@contextmanager
def backend(name: str) -> Iterator[Settings]:
    if name == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            url = f"sqlite:///{Path(tmp) / 'journal.db'}"
            upgrade(url)
            yield Settings(data_dir=Path(tmp), database_url=url)
        return
    with (
        pgdb.scratch_database("bench_entry", migrate=True) as db,
        tempfile.TemporaryDirectory() as tmp,
    ):
        yield Settings(data_dir=Path(tmp), database_url=pgdb.url(db))


def measures(store: SessionStore, n: int) -> dict[str, Callable[[], object]]:
    engine = store.engine
    if engine.dialect.name == "sqlite":
        extract = func.json_extract(_events.c.payload, "$.timestamp")
    else:
        extract = func.json_extract_path_text(_events.c.payload, "timestamp")
    since = EventFilter(entry_since=START + timedelta(seconds=n // 2))

    def scan(column: Any) -> Callable[[], object]:
        def run() -> object:
            with engine.connect() as conn:
                return conn.execute(select(func.count(column)).select_from(_events)).scalar_one()

        return run

    return {
        "floor": scan(extract),
        "entry time": scan(entry_us(engine)),
        "listing": lambda: store.list_events(since, limit=100),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backends", default="sqlite,postgres")
    args = parser.parse_args()
    print(
        f"# {args.events:,} events, {args.rounds} interleaved rounds, load {os.getloadavg()[0]:.1f}"
    )
    for name in args.backends.split(","):
        with backend(name) as settings, SessionStore.from_settings(settings) as store:
            fill(store, args.events)
            runs = measures(store, args.events)
            for fn in runs.values():
                fn()  # warm: caches, the time blocks' first summary
            times: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(args.rounds):
                for key, fn in runs.items():
                    started = time.perf_counter()
                    fn()
                    times[key].append(time.perf_counter() - started)
        print(f"\n{name}:")
        for key, values in times.items():
            med = statistics.median(values)
            low, high = min(values) * 1000, max(values) * 1000
            print(f"  {key:11} {med * 1000:8.1f} ms ({low:.1f}-{high:.1f})")
        floor, entry = statistics.median(times["floor"]), statistics.median(times["entry time"])
        per_row = (entry - floor) / args.events * 1e6
        print(f"  entry time / floor {entry / floor:.2f}x; {per_row:.1f} us a row over the floor")
    print(f"\nload after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
