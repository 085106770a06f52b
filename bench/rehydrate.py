"""Rehydrate on demand (issue 21): the ``sessionstore.rehydrate`` task's end-to-end build
against reading the same event rows and blobs directly in one process.

A session of ``--mb`` MB of rehydrated content (screenshots and long tool outputs) in a
scratch PostgreSQL database, a real prefork worker (concurrency 1) on Redis. Per round,
interleaved:

- direct: this process reads the events a page at a time, rehydrates them and writes the
  same ``events`` JSONL to a file (the floor: what any reader must do);
- task: ``enqueue_rehydrate(..., format="events")`` and wait for the result (publish,
  worker pick-up, the build with its dedup row and heartbeats, the artifact publish,
  the result round trip). The dedup row is dropped between rounds so each round builds.

Prints MB/s of each and their ratio (target: task >= 0.7x direct). Usage:

    python -m bench.rehydrate [--mb 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import base64
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from sqlalchemy import delete

from core import SessionStore, Settings
from core.interop import pi
from core.interop.exporter import rehydrated_events
from core.migrate import upgrade
from core.models import RehydrationRow, table_of
from tasks import enqueue_rehydrate
from tasks.app import create_app

ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS = os.environ.get("SESSIONSTORE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/10")
ROOT = Path(__file__).resolve().parent.parent


def build_session(store: SessionStore, mb: int) -> str:
    image = b"\x89PNG\r\n\x1a\n" + os.urandom(2 * 1024 * 1024)
    data = base64.b64encode(image).decode()
    text = "".join(f"line {i:07d} of a long tool output\n" for i in range(40_000))
    sid = store.create_session(tenant_id="bench").id
    total, i = 0, 0
    while total < mb * 10**6:
        block = (
            {"type": "image", "data": data, "mimeType": "image/png"}
            if i % 2
            else {"type": "text", "text": text}
        )
        message = {"role": "user", "content": [block]}
        store.append(sid, [{"type": "message", "id": f"m{i}", "message": message}])
        total += len(data) if i % 2 else len(text)
        i += 1
    return sid


def direct(store: SessionStore, sid: str, out: Path) -> int:
    session = store.get_session(sid)
    with out.open("w", encoding="utf-8", errors="surrogatepass") as f:
        for event in rehydrated_events(store, session, None):
            line = {
                "seq": event.seq,
                "position": event.position,
                "type": event.type,
                "recorded_at": event.recorded_at.isoformat(),
                "payload": event.payload,
            }
            f.write(pi.dumps_exact(line) + "\n")
    return out.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    name = f"bench_rh_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    tmp = Path(tempfile.mkdtemp(prefix="bench-rehydrate-"))
    settings = Settings(
        data_dir=tmp / "data", database_url=url, broker_url=REDIS, result_backend=REDIS
    )
    upgrade(url)
    env = {
        **os.environ,
        "SESSIONSTORE_DATABASE_URL": url,
        "SESSIONSTORE_BROKER_URL": REDIS,
        "SESSIONSTORE_RESULT_BACKEND": REDIS,
        "SESSIONSTORE_DATA_DIR": str(settings.data_dir),
    }
    cmd = [sys.executable, "-m", "celery", "-A", "tasks.app", "worker", "--pool", "prefork"]
    worker = subprocess.Popen(
        [*cmd, "-c", "1", "-l", "warning", "--without-mingle", "--without-gossip"],
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    app = create_app(settings)
    try:
        with SessionStore.from_settings(settings) as store:
            sid = build_session(store, args.mb)
            enqueue_rehydrate(sid, tenant_id="bench", format="events", app=app).get(timeout=600)
            rows: dict[str, list[float]] = {"direct": [], "task": [], "ratio": []}
            size = 0
            for _ in range(args.rounds):
                with store.engine.begin() as conn:
                    conn.execute(delete(table_of(RehydrationRow)))
                t0 = time.perf_counter()
                size = direct(store, sid, tmp / "direct.jsonl")
                t_direct = time.perf_counter() - t0
                t0 = time.perf_counter()
                handle = enqueue_rehydrate(sid, tenant_id="bench", format="events", app=app)
                result = handle.get(timeout=600)
                t_task = time.perf_counter() - t0
                assert result["size"] == size and not result["reused"]
                rows["direct"].append(size / 1e6 / t_direct)
                rows["task"].append(size / 1e6 / t_task)
                rows["ratio"].append(t_direct / t_task)
        load = os.getloadavg()[0]
        print(f"session: {size / 1e6:.0f} MB rehydrated (events JSONL), load avg {load:.1f}")
        for label, values in rows.items():
            unit = "x" if label == "ratio" else " MB/s"
            print(
                f"{label:>7}: median {statistics.median(values):.2f}{unit} "
                f"(min {min(values):.2f}, max {max(values):.2f})"
            )
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(30)
        app.close()
        with psycopg.connect(ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
