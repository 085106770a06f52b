"""Where the batch-100 append of the peers' 200-turn session spends its time.

    python -m bench.batch_path profile [--top 30]
    python -m bench.batch_path fsync [--files 4] [--rounds 15]

``profile``: the session of ``bench.peers.workload`` appended in calls of 100 to a fresh
PostgreSQL database and blob directory (as ``bench.peers`` does), once under cProfile
(functions by own time) and once with each SQL statement timed (by its first words).

``fsync``: the blob files' durable write, one call per file (``replace_atomically``: write,
fsync, rename, directory fsync each) against one call for all (``replace_many_atomically``),
each file in a directory of its own, as new blobs land in fresh fan-out directories;
interleaved, medians with min-max.

    python -m bench.batch_path validation [--rounds 9]

``validation``: the session's 1,010 events through ``check_batch`` (what an append pays),
and the parts of its fast path one by one (encode, the U+0000 scan, decode, compare) next to
the full walk that names a bad field; interleaved, medians with min-max.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any
from unittest import mock

import orjson
from sqlalchemy import event

from bench.peers.workload import session, split
from bench.pgdb import scratch_database, url
from core import SessionStore, Settings
from core.fsio import replace_atomically, replace_many_atomically
from core.journal import validation
from core.journal.postgres import PG_APPEND, run_append


def _load(store: SessionStore, events: list[dict[str, Any]]) -> float:
    session_id = store.journal.create_session(tenant_id="bench").id
    store.append(session_id, [{"type": "custom", "customType": "warm", "data": {}}])
    started = time.perf_counter()
    for i in range(0, len(events), 100):
        store.append(session_id, events[i : i + 100])
    return time.perf_counter() - started


def _fresh_store(tmp: str, name: str) -> SessionStore:
    blobs = Path(tmp) / "blobs"
    blobs.mkdir()
    settings = Settings(database_url=url(name), data_dir=Path(tmp), blob_url=blobs.as_uri())
    return SessionStore.from_settings(settings)


def profile(top: int) -> None:
    events, _ = split(session())
    with tempfile.TemporaryDirectory() as tmp, scratch_database("bench_bp", migrate=True) as db:
        with _fresh_store(tmp, db) as store:
            profiler = cProfile.Profile()
            profiler.enable()
            seconds = _load(store, events)
            profiler.disable()
    print(f"load under cProfile: {seconds * 1e3:.0f} ms")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)

    timings: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp, scratch_database("bench_bp", migrate=True) as db:
        with _fresh_store(tmp, db) as store:

            @event.listens_for(store.engine, "before_cursor_execute")
            def started(conn: Any, *_: Any) -> None:
                conn.info["bench_started"] = time.perf_counter()

            @event.listens_for(store.engine, "after_cursor_execute")
            def ended(conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
                spent = time.perf_counter() - conn.info.pop("bench_started")
                timings[" ".join(statement.split())[:50]].append(spent)

            # the append statement runs on the driver's cursor (core.journal.postgres), out
            # of SQLAlchemy's events: timed around the call instead
            def timed_run_append(conn: Any, keyed: bool, refs: bool, params: Any) -> Any:
                begun = time.perf_counter()
                try:
                    return run_append(conn, keyed, refs, params)
                finally:
                    statement = " ".join(PG_APPEND[keyed, refs].split())[:50]
                    timings[statement].append(time.perf_counter() - begun)

            with mock.patch("core.journal.journal.run_append", timed_run_append):
                seconds = _load(store, events)
    print(f"load with statements timed: {seconds * 1e3:.0f} ms")
    print("| ms | calls | statement |\n|---|---|---|")
    for statement, spent in sorted(timings.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {sum(spent) * 1e3:.1f} | {len(spent)} | `{statement}` |")


def fsync(files: int, rounds: int) -> None:
    data = bytes(range(256)) * 256  # 64 KiB
    samples: dict[str, list[float]] = {"one by one": [], "together": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for r in range(rounds):
            for kind in samples:  # interleaved
                paths = [root / f"{kind[0]}{r}-{i}" / "blob" for i in range(files)]
                for path in paths:
                    path.parent.mkdir()
                started = time.perf_counter()
                if kind == "together":
                    replace_many_atomically([(path, data) for path in paths])
                else:
                    for path in paths:
                        replace_atomically(path, data)
                samples[kind].append((time.perf_counter() - started) * 1e3)
    for kind, ms in samples.items():
        print(
            f"{files} files of 64 KiB, {kind}: {statistics.median(ms):.2f} ms "
            f"({min(ms):.2f}-{max(ms):.2f}), {rounds} rounds"
        )


def _walk_all(events: list[dict[str, Any]], depth: int) -> None:
    for entry in events:
        validation._walk(entry, 1, depth)


def validation_parts(rounds: int) -> None:
    events, _ = split(session())
    encoded = [orjson.dumps(e) for e in events]
    decoded = [orjson.loads(b) for b in encoded]
    depth = Settings().max_event_depth
    parts: dict[str, Any] = {
        "check_batch (all of it)": lambda: [
            validation.check_batch(events[i : i + 100], max_events=1000, max_depth=depth)
            for i in range(0, len(events), 100)
        ],
        "encode (orjson.dumps)": lambda: [orjson.dumps(e) for e in events],
        "U+0000 scan": lambda: [b"\\u0000" in b for b in encoded],
        "decode (orjson.loads)": lambda: [orjson.loads(b) for b in encoded],
        "compare": lambda: [a == b for a, b in zip(decoded, events, strict=True)],
        "walk (_walk)": lambda: _walk_all(events, depth),
    }
    samples: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(rounds):
        for name, run in parts.items():  # interleaved
            started = time.perf_counter()
            run()
            samples[name].append((time.perf_counter() - started) * 1e3)
    total = statistics.median(samples["check_batch (all of it)"])
    print(f"{len(events):,} events, {sum(map(len, encoded)) / 1e6:.2f} MB of JSON, {rounds} rounds")
    print("| part | ms | min-max | share of check_batch |\n|---|---|---|---|")
    for name, ms in samples.items():
        median = statistics.median(ms)
        print(f"| {name} | {median:.1f} | {min(ms):.1f}-{max(ms):.1f} | {median / total:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("profile").add_argument("--top", type=int, default=30)
    sync = sub.add_parser("fsync")
    sync.add_argument("--files", type=int, default=4)
    sync.add_argument("--rounds", type=int, default=15)
    sub.add_parser("validation").add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if args.what == "profile":
        profile(args.top)
    elif args.what == "validation":
        validation_parts(args.rounds)
    else:
        fsync(args.files, args.rounds)


if __name__ == "__main__":
    main()
