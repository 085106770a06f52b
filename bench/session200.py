"""The 200-turn coding session of issue 19 on PostgreSQL: batch-100 append, rebuild, storage.

    python -m bench.session200 [--rounds 5] [--profile append|rebuild]

The workload is a pi-format session of 200 turns (1,010 events, ~9 MB of JSON, 20 screenshots
of which 10 are distinct), built from ``tasks.cli.samples``. Per round, on a fresh database:

- batch-100 append: the whole session appended in batches of 100, events per second;
- rebuild: ``state(session, rehydrate=True)`` without snapshots, the median of 5 calls;
- storage: the journal's tables as PostgreSQL counts them (heap + TOAST + indexes of
  ``events`` and ``blob_refs``) plus the blob files, against the raw JSON of the workload.

``--profile`` prints a cProfile of one phase instead (the top functions by own time).
``--validation`` times the write's validation of the session against ``orjson.dumps``.
``--storage-variants`` copies the stored events into tables of other payload types and TOAST
settings and prints each one's size and full-scan read time (issue 19, item 4).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import psycopg

from core import SessionStore, Settings
from core.journal.validation import checked
from core.migrate import upgrade
from tasks.cli.samples import EntryBuilder

ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
TURNS = 200
BATCH = 100
_WORDS = (
    "the upload handler retries the storage call once before it reports the failure and the "
    "test checks that the retry count matches the configured policy for every backend"
).split()


def _text(seed: int, words: int) -> str:
    return " ".join(_WORDS[(seed * 7 + i * 3) % len(_WORDS)] for i in range(words))


def _log(seed: int, lines: int) -> str:
    return "".join(
        f"src/app/module_{(seed + i) % 17}.py:{i + 10}: {_text(seed + i, 9)} [{seed}:{i}]\n"
        for i in range(lines)
    )


def screenshot(seed: int) -> bytes:
    """A 250 KB PNG-like screenshot: noise, so neither gzip nor TOAST can shrink it."""
    return b"\x89PNG\r\n\x1a\n" + random.Random(seed).randbytes(250_000)


def workload() -> list[dict[str, Any]]:
    """1,010 events: 5 per turn, and 10 session-level entries; screenshots every 10th turn."""
    b = EntryBuilder()
    events = [b.session_info("upload retries"), b.model_change("anthropic", "claude-sonnet-4")]
    shots = [screenshot(seed) for seed in range(10)]
    for turn in range(TURNS):
        images = [shots[turn // 10 % 10]] if turn % 10 == 0 else []
        events.append(b.user(_text(turn, 60), images=images))
        call = f"call_{turn:04d}"
        events.append(
            b.assistant(
                _text(turn + 1, 40),
                thinking=_text(turn + 2, 200),
                tool_calls=[(call, "bash", {"command": f"pytest -k case_{turn}"})],
            )
        )
        events.append(b.tool_result(call, "bash", _log(turn, 60)))
        events.append(b.assistant(_text(turn + 3, 300)))
        events.append(b.user(_text(turn + 4, 30)))
        if turn % 25 == 24:
            events.append(b.thinking_level("high" if turn % 50 else "medium"))
    return events


@contextmanager
def fresh_store() -> Iterator[tuple[SessionStore, str, Path]]:
    name = f"ss_s200_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    try:
        upgrade(url)
        with tempfile.TemporaryDirectory() as tmp:
            settings = Settings(database_url=url, data_dir=Path(tmp), snapshot_every=0)
            with SessionStore.from_settings(settings) as store:
                yield store, name, Path(tmp)
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def append_all(store: SessionStore, events: list[dict[str, Any]]) -> tuple[str, float]:
    session = store.create_session(tenant_id="bench")
    start = time.perf_counter()
    for i in range(0, len(events), BATCH):
        store.append(session.id, events[i : i + BATCH])
    return session.id, len(events) / (time.perf_counter() - start)


def rebuild(store: SessionStore, session_id: str) -> float:
    start = time.perf_counter()
    state = store.state(session_id, rehydrate=True)
    elapsed = time.perf_counter() - start
    assert state.messages, "the rebuilt state shows the conversation"
    return elapsed


def storage_bytes(name: str, data_dir: Path) -> int:
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{name}", autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE events")
        row = conn.execute(
            "SELECT pg_total_relation_size('events') + pg_total_relation_size('blob_refs')"
        ).fetchone()
    assert row is not None
    files = sum(p.stat().st_size for p in (data_dir / "blobs").rglob("*") if p.is_file())
    return int(row[0]) + files


def one_round(events: list[dict[str, Any]]) -> tuple[float, float, int]:
    with fresh_store() as (store, name, data_dir):
        session_id, rate = append_all(store, events)
        rebuild(store, session_id)  # warm: connections, imports, the blob cache of the OS
        seconds = statistics.median(rebuild(store, session_id) for _ in range(5))
        return rate, seconds, storage_bytes(name, data_dir)


def profile(events: list[dict[str, Any]], phase: str) -> None:
    with fresh_store() as (store, _name, _dir):
        profiler = cProfile.Profile()
        if phase == "append":
            for _ in range(3):
                profiler.enable()
                append_all(store, events)
                profiler.disable()
        else:
            session_id, _ = append_all(store, events)
            rebuild(store, session_id)
            profiler.enable()
            for _ in range(5):
                rebuild(store, session_id)
            profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


# (label, payload type, compression, toast_tuple_target)
VARIANTS = (
    ("jsonb, pglz (before 0009)", "jsonb", "pglz", 2032),
    ("json, pglz (0009)", "json", "pglz", 2032),
    ("json, lz4", "json", "lz4", 2032),
    ("json, pglz, toast_tuple_target 256", "json", "pglz", 256),
    ("json, lz4, toast_tuple_target 256", "json", "lz4", 256),
    ("json, lz4, toast_tuple_target 128", "json", "lz4", 128),
)


def storage_variants(events: list[dict[str, Any]], rounds: int) -> None:
    with fresh_store() as (store, name, data_dir):
        append_all(store, events)
        blob_files = storage_bytes(name, data_dir) - _journal_bytes(name, "events", "blob_refs")
        with psycopg.connect(
            f"postgresql://postgres@127.0.0.1:5432/{name}", autocommit=True
        ) as conn:
            for i, (_label, kind, codec, target) in enumerate(VARIANTS):
                conn.execute(
                    f"CREATE TABLE v{i} (position BIGINT PRIMARY KEY, session_id VARCHAR(36), "
                    f"seq BIGINT, type VARCHAR(256), payload {kind} COMPRESSION {codec}, "
                    f"recorded_at TIMESTAMPTZ, UNIQUE (session_id, seq)) "
                    f"WITH (toast_tuple_target = {target})"
                )
                conn.execute(
                    f"INSERT INTO v{i} SELECT position, session_id, seq, type, "
                    f"payload::text::{kind}, recorded_at FROM events"
                )
                conn.execute(f"VACUUM ANALYZE v{i}")
            timings: dict[int, list[float]] = {i: [] for i in range(len(VARIANTS))}
            for _ in range(rounds):  # interleaved: every variant once per round
                for i in timings:
                    start = time.perf_counter()
                    rows = conn.execute(f"SELECT payload::text FROM v{i} ORDER BY seq").fetchall()
                    timings[i].append(time.perf_counter() - start)
                    assert len(rows) == len(events)
            raw = sum(len(orjson.dumps(e)) for e in events)
            print(f"blob files: {blob_files / 1e6:.2f} MB; raw JSON {raw / 1e6:.2f} MB")
            print("| payload storage | events table | + blobs + refs | x raw | full read ms |")
            print("|---|---|---|---|---|")
            refs = _journal_bytes(name, "blob_refs")
            for i, (label, *_rest) in enumerate(VARIANTS):
                size = _journal_bytes(name, f"v{i}")
                total = size + refs + blob_files
                ms = sorted(t * 1e3 for t in timings[i])
                print(
                    f"| {label} | {size / 1e6:.2f} MB | {total / 1e6:.2f} MB | {total / raw:.2f}x "
                    f"| {statistics.median(ms):.1f} ({ms[0]:.1f}-{ms[-1]:.1f}) |"
                )


def validation(events: list[dict[str, Any]], rounds: int) -> None:
    """The write's validation of the whole session (``checked``, what every append runs)
    against its floor, the bare ``orjson.dumps`` of each event that any store of JSON pays:
    interleaved, 15 runs of each per round."""
    depth = Settings().max_event_depth
    floor: list[float] = []
    ours: list[float] = []
    for _ in range(rounds):
        for _ in range(15):
            start = time.perf_counter()
            for event in events:
                orjson.dumps(event)
            floor.append(time.perf_counter() - start)
            start = time.perf_counter()
            checked(events, max_depth=depth)
            ours.append(time.perf_counter() - start)
    for label, times in (("orjson.dumps (floor)", floor), ("validation (checked)", ours)):
        ms = sorted(t * 1e3 for t in times)
        print(f"{label}: {statistics.median(ms):.1f} ms ({ms[0]:.1f}-{ms[-1]:.1f})")
    print(f"validation / floor: {statistics.median(ours) / statistics.median(floor):.2f}x")


def _journal_bytes(name: str, *tables: str) -> int:
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{name}") as conn:
        row = conn.execute(
            "SELECT " + " + ".join(f"pg_total_relation_size('{t}')" for t in tables)
        ).fetchone()
    assert row is not None
    return int(row[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", choices=("append", "rebuild"))
    parser.add_argument("--storage-variants", action="store_true")
    parser.add_argument(
        "--validation", action="store_true", help="time validation against orjson.dumps"
    )
    args = parser.parse_args()
    events = workload()
    raw = sum(len(orjson.dumps(e)) for e in events)
    print(f"workload: {len(events)} events, {raw / 1e6:.2f} MB of JSON; load {os.getloadavg()}")
    if args.profile:
        profile(events, args.profile)
        return
    if args.storage_variants:
        storage_variants(events, args.rounds)
        return
    if args.validation:
        validation(events, args.rounds)
        return
    rates, rebuilds, sizes = [], [], []
    for i in range(args.rounds):
        rate, seconds, size = one_round(events)
        rates.append(rate)
        rebuilds.append(seconds)
        sizes.append(size)
        print(
            f"round {i + 1}: batch-100 {rate:,.0f} ev/s, rebuild {seconds * 1e3:.1f} ms, "
            f"storage {size / 1e6:.2f} MB ({size / raw:.2f}x raw)",
            flush=True,
        )

    def spread(values: list[float], fmt: str) -> str:
        return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-" + (
            f"{fmt.format(max(values))})"
        )

    print(f"batch-100 append ev/s: {spread(rates, '{:,.0f}')}")
    print(f"rebuild ms: {spread([r * 1e3 for r in rebuilds], '{:.1f}')}")
    print(
        f"storage MB: {spread([s / 1e6 for s in sizes], '{:.2f}')}; "
        f"{statistics.median(sizes) / raw:.2f}x raw; load {os.getloadavg()}"
    )


if __name__ == "__main__":
    main()
