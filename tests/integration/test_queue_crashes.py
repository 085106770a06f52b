"""The queue under unlucky timing: broker killed with -9, worker SIGKILLed in a loop.

After each run every write is in the journal exactly once; a worker that lost its broker
is running again or has exited non-zero (a supervisor restarts it), never exit 0.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from core import SessionStore, Settings
from tasks import Producer
from tasks.app import create_app
from tests.support import WorkerProcess, redis_server, settings_env, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]


def markers(store: SessionStore) -> Counter[str]:
    with store.engine.connect() as conn:
        rows = conn.execute(text("SELECT payload FROM events ORDER BY position")).scalars()
        payloads = [json.loads(r) if isinstance(r, str) else r for r in rows]
    return Counter(p["marker"] for p in payloads if "marker" in p)


def note(marker: str) -> dict[str, Any]:
    return {"type": "note", "marker": marker}


@pytest.fixture
def store(queue_settings: Settings) -> Iterator[SessionStore]:
    with SessionStore.from_settings(queue_settings) as s:
        yield s


def test_broker_killed_ten_times_worker_survives_or_fails_loudly(
    store: SessionStore, queue_settings: Settings, tmp_path: Path
) -> None:
    (tmp_path / "redis").mkdir()
    with redis_server(tmp_path / "redis") as broker:
        settings = queue_settings.with_overrides(
            broker_url=broker.url, result_backend=broker.url, task_visibility_timeout=10
        )
        env = settings_env(
            database_url=str(settings.database_url),
            broker_url=broker.url,
            data_dir=tmp_path / "w",
            visibility_timeout=10,
        )
        producer = Producer(create_app(settings), confirm_timeout=15)
        sid = store.create_session(tenant_id="acme").id
        log = tmp_path / "worker.log"
        workers = [WorkerProcess(env, log)]
        exits: list[int] = []
        sent: list[str] = []
        stop = threading.Event()

        def produce() -> None:
            n = 0
            while not stop.is_set():
                key = f"w{n}"
                try:
                    producer.append(sid, [note(key)], idempotency_key=key)
                except Exception:  # the broker is down past the publish retries: try again
                    time.sleep(0.5)
                    continue
                sent.append(key)
                n += 1
                time.sleep(0.01)

        thread = threading.Thread(target=produce)
        thread.start()
        try:
            for _ in range(10):
                time.sleep(2)
                broker.kill()
                time.sleep(1)
                broker.start()
                code = workers[-1].proc.poll()
                if code is not None:  # the worker gave up: it must say so
                    exits.append(code)
                    workers.append(WorkerProcess(env, log))  # as a supervisor would
            stop.set()
            thread.join(60)
            producer.drain(timeout=120, resend_every=15)
        finally:
            stop.set()
            for worker in workers:
                worker.stop()
    assert all(code != 0 for code in exits), f"a worker exited 0 after broker loss: {exits}"
    counts = markers(store)
    assert set(counts) == set(sent) and set(counts.values()) == {1}
    assert len(sent) > 100
