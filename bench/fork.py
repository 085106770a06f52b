"""Fork cost vs blob bytes (issue 6).

A 10,000-event coding-agent session with 200 artifacts, with ~10, ~50 and ~200 MB of blob
content (the same 500 blob references, only their size differs), in a scratch PostgreSQL
database per scenario (created and dropped). For each, the median of
``--forks`` forks at the head:

- time to a usable fork: ``store.fork`` returning (events, manifest rows, artifact rows,
  counters and snapshots committed; inherited artifacts resolve from the parent);
- time to a completed copy: the fork plus its artifact copy (``copy_fork_artifacts``, the
  body of the ``sessionstore.copy_artifacts`` task, run in this process);
- bytes added: journal tables (``pg_total_relation_size``), blob store, artifact files.

Target: the fork's cost does not grow with blob bytes. Usage:

    python -P bench/fork.py [--events 10000] [--artifacts 200] [--blob-mb 10,50,200] [--forks 5]

(``-P``: bench/queue.py must not shadow the standard library's ``queue``.)
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from core import SessionStore, Settings
from core.migrate import upgrade
from core.records import Session
from tasks.cli.samples import EntryBuilder

ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
BATCH = 100
BLOB_REFS = 500
JOURNAL_TABLES = ("sessions", "events", "blob_refs", "artifacts", "counters", "snapshots")


@dataclass
class Result:
    blob_mb: int
    blob_raw: int
    blob_stored: int
    build_s: float
    fork_s: float
    copy_s: float
    state_s: float
    journal_bytes: int
    blob_bytes: int
    artifact_bytes: int
    events: int
    refs: int
    artifacts: int


@contextmanager
def scratch_database(dsn: str) -> Iterator[str]:
    name = f"bench_fork_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{dsn.rsplit('/', 1)[0].replace('postgresql://', 'postgresql+psycopg://', 1)}/{name}"
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def journal_bytes(store: SessionStore) -> int:
    names = ", ".join(f"'{t}'" for t in JOURNAL_TABLES)
    with store.engine.connect() as conn:
        value = conn.exec_driver_sql(
            f"SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c "
            f"JOIN pg_namespace n ON n.oid = c.relnamespace "
            f"WHERE n.nspname = 'public' AND c.relkind = 'r' AND c.relname IN ({names})"
        ).scalar()
    return int(value or 0)


def build_parent(store: SessionStore, events: int, artifacts: int, blob_bytes: int) -> str:
    """Turns of user / assistant-with-tool-call / tool-result; 500 tool results spread over
    the session carry a big unique output (a blob each). Artifacts are spread likewise."""
    sid = store.create_session(tenant_id="bench", title="fork bench", cwd="/work/app").id
    b = EntryBuilder()
    manager = store.artifacts(sid)
    blob_every = max(1, (events // 3) // BLOB_REFS)
    artifact_every = max(1, events // artifacts)
    blob_chars = blob_bytes // BLOB_REFS
    batch: list[dict[str, Any]] = []
    made = big = 0
    for i in range(events):
        if i % 3 == 0:
            batch.append(b.user(f"step {i}: run the tests and fix what fails"))
        elif i % 3 == 1:
            batch.append(b.assistant("running", tool_calls=[(f"c{i}", "bash", {"cmd": "pytest"})]))
        else:
            is_big = (i // 3) % blob_every == 0 and big < BLOB_REFS
            big += is_big
            text = secrets.token_hex(blob_chars // 2) if is_big else f"ok {i}\n" * 20
            batch.append(b.tool_result(f"c{i - 1}", "bash", text))
        if len(batch) == BATCH:
            store.append(sid, batch)
            batch = []
        if i % artifact_every == 0 and made < artifacts:
            add_artifact(manager, made)
            made += 1
    if batch:
        store.append(sid, batch)
    return sid


def add_artifact(manager: Any, n: int) -> None:
    body = f"artifact {n}\n" + "log line with some detail\n" * 300  # ~8 KB
    if n % 5 < 3:
        manager.save(body, "bash")
    elif n % 5 == 3:
        manager.save_agent_output(f"agent{n}", body, jsonl='{"event": "done"}\n' * 20)
    else:
        manager.files.put(f"work/{n % 7}/file{n}.txt", body * 2)


def measure(store: SessionStore, sid: str, forks: int) -> tuple[float, float, float, list[Session]]:
    pending: list[Session] = []
    store.fork_copier = pending.append  # the queue's hand-over, minus the broker
    fork_times, copy_times, state_times, made = [], [], [], []
    for _ in range(forks):
        started = time.perf_counter()
        fork = store.fork(sid)
        fork_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        store.state(fork.id)
        state_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        report = store.copy_fork_artifacts(fork.id)
        copy_times.append(time.perf_counter() - started)
        assert report.status == "copied", report
        made.append(fork)
    return (
        statistics.median(fork_times),
        statistics.median(copy_times),
        statistics.median(state_times),
        made,
    )


def scenario(dsn: str, blob_mb: int, events: int, artifacts: int, forks: int) -> Result:
    with scratch_database(dsn) as url, tempfile.TemporaryDirectory(prefix="bench-fork-") as tmp:
        upgrade(url)
        settings = Settings(data_dir=Path(tmp), database_url=url)
        with SessionStore.from_settings(settings) as store:
            started = time.perf_counter()
            sid = build_parent(store, events, artifacts, blob_mb * 1024 * 1024)
            build_s = time.perf_counter() - started
            store.state(sid)  # the parent's snapshots exist, as for any session that was read
            stats = store.blob_stats()
            blob_dir = Path(tmp) / "blobs"
            art_root = settings.resolved_artifact_root
            before = (journal_bytes(store), dir_bytes(blob_dir), dir_bytes(art_root))
            fork_s, copy_s, state_s, made = measure(store, sid, forks)
            after = (journal_bytes(store), dir_bytes(blob_dir), dir_bytes(art_root))
            fork_events = store.read(made[0].id, limit=events + 1)
            manifest = store.journal.manifest([e.position for e in fork_events])
            return Result(
                blob_mb=blob_mb,
                blob_raw=stats.raw_bytes,
                blob_stored=stats.stored_bytes,
                build_s=build_s,
                fork_s=fork_s,
                copy_s=copy_s,
                state_s=state_s,
                journal_bytes=(after[0] - before[0]) // forks,
                blob_bytes=(after[1] - before[1]) // forks,
                artifact_bytes=(after[2] - before[2]) // forks,
                events=len(fork_events),
                refs=sum(len(v) for v in manifest.values()),
                artifacts=len(store.artifacts(made[0].id).list()),
            )


def table(results: list[Result]) -> str:
    def row(label: str, values: list[str]) -> str:
        return f"| {label} | " + " | ".join(values) + " |"

    mb = [f"{r.blob_mb} MB of blobs" for r in results]
    lines = [
        row("", mb),
        row("---", ["---"] * len(results)),
        row(
            "blobs: raw / stored (gzip)",
            [f"{r.blob_raw / 1e6:.1f} MB / {r.blob_stored / 1e6:.1f} MB" for r in results],
        ),
        row("building the parent", [f"{r.build_s:.1f} s" for r in results]),
        row(
            "fork: events / manifest rows / artifacts",
            [f"{r.events:,} / {r.refs} / {r.artifacts}" for r in results],
        ),
        row("**time to a usable fork**", [f"**{r.fork_s * 1000:.0f} ms**" for r in results]),
        row("first state() of the fork", [f"{r.state_s * 1000:.0f} ms" for r in results]),
        row("artifact copy", [f"{r.copy_s * 1000:.0f} ms" for r in results]),
        row(
            "**time to a completed copy**",
            [f"**{(r.fork_s + r.copy_s) * 1000:.0f} ms**" for r in results],
        ),
        row("bytes added: journal tables", [f"{r.journal_bytes / 1e6:.2f} MB" for r in results]),
        row("bytes added: blob store", [f"{r.blob_bytes:,} B" for r in results]),
        row("bytes added: artifact files", [f"{r.artifact_bytes / 1e6:.2f} MB" for r in results]),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--artifacts", type=int, default=200)
    parser.add_argument("--blob-mb", default="10,50,200", help="Blob sizes to compare (MB).")
    parser.add_argument("--forks", type=int, default=5, help="Forks per scenario (median).")
    parser.add_argument("--pg-dsn", default=ADMIN)
    args = parser.parse_args()
    results = []
    for blob_mb in (int(v) for v in args.blob_mb.split(",")):
        print(
            f"scenario: {args.events:,} events, {args.artifacts} artifacts, {blob_mb} MB of blobs"
        )
        results.append(scenario(args.pg_dsn, blob_mb, args.events, args.artifacts, args.forks))
    print(table(results))


if __name__ == "__main__":
    main()
