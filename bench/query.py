"""Benchmark of the query layer (issue 8).

1. Rebuild the state of a 100,000-event coding-agent session from scratch (no snapshots) and,
   in the same run, read the same rows raw with the driver and parse them with orjson: the
   physical limit. Target: rebuild rate >= 0.5x the raw rate.
2. With snapshots (every 500 events), the time to the state at the head of a 100,000-event
   session vs a 1,000-event one. Target: within 3x. Measured at the snapshot boundary and
   with a 250-event tail after it.

Both backends: SQLite (a scratch file) and PostgreSQL (a scratch database, created and
dropped). Medians of repeated runs. Usage:

    python bench/query.py [--events 100000] [--backends sqlite,postgres] [--record]
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from itertools import islice
from pathlib import Path
from typing import Any

import orjson
import psycopg

from core import SessionStore, Settings
from core.migrate import upgrade
from core.query.snapshots import fold_at, list_snapshots, session_state
from core.records import PreparedEvent

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "RESULTS.md"
HEADING = "## Query (issue 8)"
WORDS = (
    "the function returns a list of files and the test checks that each one is parsed "
    "correctly before the session state is rebuilt from the journal with snapshots"
).split()


class Agent:
    """A deterministic coding-agent session: turns with tool calls, compaction when the
    context grows past a token budget, and now and then a model change, a label, a custom
    entry, or a branch back a few turns with a branch summary."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.leaf: str | None = None
        self.count = 0
        self.context: list[str] = []  # entry ids since the last compaction
        self.context_tokens = 0
        self.clock = datetime(2026, 1, 5, tzinfo=UTC)

    def _text(self, low: int, high: int) -> str:
        n = self.rng.randint(low, high) // 6
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def _entry(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.count += 1
        entry_id = f"{self.count:08x}"
        self.clock += timedelta(seconds=3)
        entry = {
            "type": kind,
            "id": entry_id,
            "parentId": self.leaf,
            "timestamp": self.clock.isoformat(),
            **fields,
        }
        self.leaf = entry_id
        self.context.append(entry_id)
        return entry

    def _usage(self, tokens_in: int, tokens_out: int) -> dict[str, Any]:
        return {
            "input": tokens_in,
            "output": tokens_out,
            "cacheRead": tokens_in // 2,
            "cacheWrite": 200,
            "totalTokens": tokens_in + tokens_out,
            "cost": {"input": 0.001, "output": 0.002, "total": 0.003},
        }

    def turn(self) -> Iterator[dict[str, Any]]:
        rng = self.rng
        yield self._entry("message", message={"role": "user", "content": self._text(40, 300)})
        for _ in range(rng.choice((1, 1, 2, 3))):
            calls = [f"toolu_{uuid.UUID(int=rng.getrandbits(128)).hex[:20]}"]
            tool = rng.choice(("bash", "read", "edit", "grep"))
            yield self._entry(
                "message",
                message={
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": self._text(80, 400)},
                        {"type": "text", "text": self._text(40, 300)},
                        {
                            "type": "toolCall",
                            "id": calls[0],
                            "name": tool,
                            "arguments": {"command": self._text(10, 80), "timeout": 120},
                        },
                    ],
                    "api": "anthropic-messages",
                    "provider": "anthropic",
                    "model": "claude-sonnet-4-5",
                    "usage": self._usage(self.context_tokens, rng.randint(50, 900)),
                    "stopReason": "toolUse",
                },
            )
            yield self._entry(
                "message",
                message={
                    "role": "toolResult",
                    "toolCallId": calls[0],
                    "toolName": tool,
                    "content": [{"type": "text", "text": self._text(100, 2500)}],
                    "isError": rng.random() < 0.05,
                },
            )
            self.context_tokens += rng.randint(500, 3000)
        yield self._entry(
            "message",
            message={
                "role": "assistant",
                "content": [{"type": "text", "text": self._text(40, 600)}],
                "provider": "anthropic",
                "model": "claude-sonnet-4-5",
                "usage": self._usage(self.context_tokens, rng.randint(50, 900)),
                "stopReason": "stop",
            },
        )

    def stream(self) -> Iterator[dict[str, Any]]:
        """The header, then entries for as long as the caller takes them."""
        yield {"type": "session", "version": 3, "id": "bench", "cwd": "/work/app"}
        while True:
            yield from self.turn()
            yield from self._extras()

    def _extras(self) -> list[dict[str, Any]]:
        rng, out = self.rng, []
        if self.context_tokens > 150_000:  # the context window is full: compact
            kept = self.context[-rng.randint(8, 30)]
            out.append(
                self._entry(
                    "compaction",
                    summary=self._text(800, 3000),
                    firstKeptEntryId=kept,
                    tokensBefore=self.context_tokens,
                )
            )
            self.context = self.context[self.context.index(kept) :]
            self.context_tokens = 20_000
        roll = rng.random()
        if roll < 0.01:
            out.append(self._entry("model_change", provider="anthropic", modelId="claude-opus-4"))
        elif roll < 0.02:
            out.append(self._entry("label", targetId=self.leaf, label="checkpoint"))
        elif roll < 0.04:
            out.append(self._entry("custom", customType="todo", data={"open": rng.randint(0, 9)}))
        elif roll < 0.045 and len(self.context) > 12:
            self.leaf = self.context[-rng.randint(6, 12)]  # go back a few turns
            out.append(
                self._entry("branch_summary", fromId=self.leaf, summary=self._text(200, 600))
            )
        return out


# backends -------------------------------------------------------------------------------


@contextmanager
def sqlite_backend() -> Iterator[tuple[str, Callable[[str], float]]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.db"
        url = f"sqlite:///{path}"
        upgrade(url)

        def raw(session_id: str) -> float:
            conn = sqlite3.connect(path)
            try:
                started = time.perf_counter()
                cursor = conn.execute(
                    "SELECT seq, type, payload FROM events WHERE session_id = ? ORDER BY seq",
                    (session_id,),
                )
                parsed = [(seq, kind, orjson.loads(p)) for seq, kind, p in cursor]
                elapsed = time.perf_counter() - started
            finally:
                conn.close()
            assert parsed
            return elapsed

        yield url, raw


@contextmanager
def postgres_backend(dsn: str) -> Iterator[tuple[str, Callable[[str], float]]]:
    name = f"ss_bench_q_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    db_dsn = dsn.rsplit("/", 1)[0] + "/" + name
    url = db_dsn.replace("postgresql://", "postgresql+psycopg://", 1)
    try:
        upgrade(url)

        def raw(session_id: str) -> float:
            with psycopg.connect(db_dsn) as conn:
                started = time.perf_counter()
                cursor = conn.execute(
                    "SELECT seq, type, payload::text FROM events WHERE session_id = %s "
                    "ORDER BY seq",
                    (session_id,),
                )
                parsed = [(seq, kind, orjson.loads(p)) for seq, kind, p in cursor]
                elapsed = time.perf_counter() - started
            assert parsed
            return elapsed

        yield url, raw
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# measurements ---------------------------------------------------------------------------


def load(store: SessionStore, events: Iterator[dict[str, Any]]) -> str:
    session = store.create_session(tenant_id="bench")
    batch: list[PreparedEvent] = []
    for event in events:
        batch.append(PreparedEvent(type=event["type"], payload=event))
        if len(batch) == 1000:
            store.journal.append(session.id, batch)
            batch = []
    if batch:
        store.journal.append(session.id, batch)
    return session.id


def _remember(
    events: Iterator[dict[str, Any]], into: deque[dict[str, Any]]
) -> Iterator[dict[str, Any]]:
    for event in events:
        into.append(event)
        yield event


def median_time(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench_backend(
    label: str, url: str, raw: Callable[[str], float], n: int, runs: int
) -> dict[str, Any]:
    settings = Settings(data_dir=Path(tempfile.gettempdir()) / "ss-bench-q", database_url=url)
    out: dict[str, Any] = {"backend": label}
    with SessionStore.from_settings(settings.with_overrides(snapshot_every=500)) as store:
        started = time.perf_counter()
        agent = Agent(1)
        stream = agent.stream()
        recent: deque[dict[str, Any]] = deque(maxlen=999)
        big = load(store, _remember(islice(stream, n), recent))
        # The 1,000-event session is the big one's last 999 events after a header: the same
        # context at the head (compactions keep recent entries), 100x less history.
        small = load(store, iter([next(Agent(2).stream()), *recent]))
        out["load_s"] = time.perf_counter() - started
        journal = store.journal

        # 1. rebuild from scratch vs raw read + parse, interleaved
        raw_times, rebuild_times, fold_times = [], [], []
        for _ in range(runs):
            raw_times.append(raw(big))
            started = time.perf_counter()
            state = session_state(journal, big, snapshot_every=0)
            rebuild_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            fold_at(journal, big, n, snapshot_every=0)
            fold_times.append(time.perf_counter() - started)
        assert state.counters.events == n
        out.update(
            raw_s=statistics.median(raw_times),
            rebuild_s=statistics.median(rebuild_times),
            fold_s=statistics.median(fold_times),
            context_messages=len(state.messages),
            small_context_messages=len(store.state(small, rehydrate=False).messages),
            entries=len(state.tree),
        )
        out["ratio"] = out["raw_s"] / out["rebuild_s"]

        # 2. with snapshots: state at the head, 100k vs 1k events
        def at_head(session_id: str) -> Callable[[], object]:
            return lambda: store.state(session_id, rehydrate=False)

        for sid in (big, small):
            at_head(sid)()  # the first read stores the snapshot at the head
        out["head_big_s"] = median_time(at_head(big), runs * 7)
        out["head_small_s"] = median_time(at_head(small), runs * 7)
        tail = [PreparedEvent(e["type"], e) for e in islice(stream, 250)]
        for sid in (big, small):
            store.journal.append(sid, tail)
        out["tail_big_s"] = median_time(at_head(big), runs * 7)
        out["tail_small_s"] = median_time(at_head(small), runs * 7)
        sizes = {seq: size for _, seq, size in list_snapshots(store.engine, big)}
        out["snapshot_bytes"] = sizes.get(n, 0)
    return out


def report(results: list[dict[str, Any]], n: int, command: str) -> str:
    lines = [
        HEADING,
        "",
        f"Command: `{command}`",
        "",
        "Machine: 2 vCPUs shared with three other engineers' test runs, so absolute times "
        "are noisy; raw and rebuild runs are interleaved so their ratio is less so.",
        "",
        f"A {n:,}-event coding-agent session (turns with tool calls, compaction when the context "
        "passes 150k tokens, occasional model changes, labels, custom entries and branches); "
        "medians. *Raw* = the driver reads `(seq, type, payload)` of the session in seq "
        "order and orjson parses each payload. *Rebuild* = `state()` without snapshots: "
        "paged reads through the journal, the fold, reading the context entries, the "
        "artifacts index. *Fold* = the paged read + fold alone.",
        "",
        "| backend | raw read+parse | rebuild | fold only | rebuild rate / raw rate "
        "(target ≥ 0.5x) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['backend']} | {r['raw_s']:.2f} s | {r['rebuild_s']:.2f} s | "
            f"{r['fold_s']:.2f} s | **{r['ratio']:.2f}x** |"
        )
    lines += [
        "",
        "With snapshots every 500 events, time to the state at the head, at a snapshot and "
        "with 250 events to fold after it:",
        "",
        f"| backend | head at a snapshot: {n // 1000}k / 1k | ratio (target ≤ 3x) | "
        f"250-event tail after it: {n // 1000}k / 1k | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['backend']} | {r['head_big_s'] * 1000:.1f} ms / "
            f"{r['head_small_s'] * 1000:.1f} ms | **{r['head_big_s'] / r['head_small_s']:.2f}x** | "
            f"{r['tail_big_s'] * 1000:.1f} ms / {r['tail_small_s'] * 1000:.1f} ms | "
            f"**{r['tail_big_s'] / r['tail_small_s']:.2f}x** |"
        )
    lines += [
        "",
        "The 1k session is the 100k one's last 999 events after a header, so both heads "
        f"show the same context ({results[0]['context_messages']} messages) and only the "
        "history differs. Snapshot at the 100k head: "
        + ", ".join(f"{r['backend']} {r['snapshot_bytes'] / 1024:.0f} KiB" for r in results)
        + ". It stays small because the fold keeps no message content: the tree is stored as "
        "runs and exceptions plus compressed chunks of entry ids (only the last chunk is "
        "decoded at the head), and the context entries are read after the fold.",
        "",
    ]
    return "\n".join(lines)


def record(section: str) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\n"
    if HEADING in text:
        start = text.index(HEADING)
        following = text.find("\n## ", start + len(HEADING))
        end = len(text) if following == -1 else following + 1
        text = text[:start] + section + text[end:]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pg-dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--record", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args()
    results = []
    for backend in args.backends.split(","):
        ctx = sqlite_backend() if backend == "sqlite" else postgres_backend(args.pg_dsn)
        with ctx as (url, raw):
            result = bench_backend(backend, url, raw, args.events, args.runs)
        print(result, flush=True)
        results.append(result)
    command = "python bench/query.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in {"record"}
    )
    section = report(results, args.events, command)
    print(section)
    if args.record:
        record(section)


if __name__ == "__main__":
    main()
