"""Benchmark of one ``stats()`` call on a small journal, on both backends: the fixed cost
of a call (what an analyst's dashboard or ``sessionstore stats`` pays every time), where the
journal's size does not dominate (``bench.scale`` measures how a call grows with it).

A journal of N assistant messages with usage across a few sessions, then, interleaved
round by round:

- **floor**: the driver alone counts the events by type and sums one usage field (the least
  any stats call reads, in one prepared statement);
- **stats()**: ``core.query.stats.stats`` on a warm store (rollup up to date, so the call
  reads the rollup and the live tail, as it does between appends).

Prints medians with min-max and the ratio. Usage:

    python -m bench.stats_calls [--events 500] [--calls 30] [--rounds 5]
                                [--backends sqlite,postgres]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from bench import pgdb
from bench.query import median_time
from core import SessionStore, Settings
from core.migrate import upgrade
from core.query.stats import stats

_FLOOR = {
    "sqlite": "SELECT type, count(*), sum(json_extract(payload, '$.message.usage.input'))"
    " FROM events GROUP BY type",
    "postgresql": "SELECT type, count(*),"
    " sum((json_extract_path_text(payload, 'message', 'usage', 'input'))::numeric)"
    " FROM events GROUP BY type",
}


@contextmanager
def _store(backend: str, events: int) -> Iterator[SessionStore]:
    with tempfile.TemporaryDirectory() as tmp, _database(backend, Path(tmp)) as url:
        upgrade(url)
        with SessionStore.from_settings(Settings(data_dir=Path(tmp), database_url=url)) as store:
            sessions = [store.create_session(tenant_id=f"t{i % 2}").id for i in range(5)]
            for i in range(events):
                message = {
                    "role": "assistant",
                    "content": [{"type": "text", "text": f"step {i}"}],
                    "model": "m1",
                    "usage": {"input": 100 + i, "output": 7, "cacheRead": 0, "cacheWrite": 0},
                }
                store.append(sessions[i % 5], [{"type": "message", "message": message}])
            stats(store.engine)  # rolls up what is sealed, as every call does first
            yield store


@contextmanager
def _database(backend: str, folder: Path) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{folder / 'journal.db'}"
        return
    with pgdb.scratch_database("bench_stats") as name:
        yield pgdb.url(name)


def _floor_call(store: SessionStore) -> Callable[[], None]:
    sql = _FLOOR[store.engine.dialect.name]

    def floor() -> None:
        with store.engine.connect() as conn:
            cursor = conn.connection.cursor()
            cursor.execute(sql)
            cursor.fetchall()
            cursor.close()

    return floor


def _fmt(values: list[float]) -> str:
    return (
        f"{statistics.median(values) * 1e3:.1f} ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=500)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backends", default="sqlite,postgres")
    args = parser.parse_args()
    print(f"stats() on {args.events:,} events; ms per call, medians of {args.rounds} rounds")
    print("| backend | floor (driver) | stats() | stats() / floor |")
    print("|---|---|---|---|")
    for backend in args.backends.split(","):
        with _store(backend, args.events) as store:
            floors, ours = [], []
            floor = _floor_call(store)
            for _ in range(args.rounds):  # interleaved
                floors.append(median_time(floor, args.calls))
                ours.append(median_time(lambda: stats(store.engine), args.calls))
            ratio = statistics.median(o / f for o, f in zip(ours, floors, strict=True))
            print(f"| {backend} | {_fmt(floors)} | {_fmt(ours)} | {ratio:.1f}x |")


if __name__ == "__main__":
    main()
