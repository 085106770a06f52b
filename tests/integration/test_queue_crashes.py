"""The queue under unlucky timing: broker killed with -9, worker SIGKILLed in a loop.

After each run every write is in the journal exactly once; a worker that lost its broker
is running again or has exited non-zero (a supervisor restarts it), never exit 0.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import text

from core import SessionStore, Settings
from tasks import Producer
from tasks.app import QUEUE, create_app
from tasks.results import QueueTimeout
from tests.support import SupervisedWorker, WorkerProcess, redis_server, settings_env, wait_for

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
        worker = SupervisedWorker(env, tmp_path / "worker.log")
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
            stop.set()
            thread.join(60)
            producer.drain(timeout=300, resend_every=15, stall_timeout=60)
        finally:
            stop.set()
            worker.stop()
    exits = worker.exits  # a worker that gave up must have said so
    assert all(code != 0 for code in exits), f"a worker exited 0 after broker loss: {exits}"
    counts = markers(store)
    assert set(counts) == set(sent) and set(counts.values()) == {1}
    assert len(sent) > 100


def _queue_depth(url: str) -> str:
    client = redis.Redis.from_url(url)
    try:
        return f"{client.llen(QUEUE)} queued, {client.hlen('unacked')} unacked"
    finally:
        client.close()


def _ready_count(log: Path) -> int:
    return log.read_text(errors="replace").count(" ready.") if log.exists() else 0


# Five runs, as issue 15 asks; each takes ~20 s alone on 2 idle cores and ~50 s when three
# run at once (it is CPU-bound: a worker start per kill). A developer may lower the count
# with this variable; CI runs all five.
CRASH_LOOP_RUNS = int(os.environ.get("SESSIONSTORE_CRASH_LOOP_RUNS", "5"))


@pytest.mark.parametrize("run", range(CRASH_LOOP_RUNS))
def test_crash_loop_every_write_exactly_once(
    run: int, store: SessionStore, queue_settings: Settings, tmp_path: Path
) -> None:
    """1,000 writes while the worker is SIGKILLed 1 s into each life; the producer
    re-sends what is unconfirmed. Five runs (parametrized): each must be exact."""
    settings = queue_settings.with_overrides(task_visibility_timeout=10)
    env = settings_env(
        database_url=str(settings.database_url),
        broker_url=str(settings.broker_url),
        data_dir=tmp_path / "w",
        visibility_timeout=10,
    )
    producer = Producer(create_app(settings), confirm_timeout=6)
    sessions = [store.create_session(tenant_id="acme").id for _ in range(4)]
    keys = [f"r{run}-{i}" for i in range(1000)]
    log = tmp_path / "worker.log"
    worker = WorkerProcess(env, log)
    kills = 0

    def produce() -> None:  # a steady stream of ~80 writes/s, so kills land mid-stream
        for i, key in enumerate(keys):
            producer.append(sessions[i % 4], [note(key)], idempotency_key=key)
            time.sleep(0.0125)

    thread = threading.Thread(target=produce)
    thread.start()
    try:
        # Killed while the stream lasts (five times at least), then left to drain: killing
        # on until every write was confirmed only added worker starts (18 of them in a run
        # on a loaded 2-core machine, 1,755 deliveries for 1,000 writes) and CI minutes.
        deadline = time.monotonic() + 150
        while (thread.is_alive() or kills < 5) and time.monotonic() < deadline:
            up = kills + 1  # workers started so far, each logs "ready" once
            wait_for(lambda n=up: _ready_count(log) >= n, 60, "the worker to be ready")
            time.sleep(1)
            worker.kill()
            kills += 1
            worker = WorkerProcess(env, log)
            producer.resend_unconfirmed()
        thread.join(300)  # on a loaded machine the stream can outlast the kill loop
        assert not thread.is_alive(), "the producer did not finish sending"
        # A backlog behind slow workers may take its time (a CI run on a loaded machine ran
        # out a 90 s limit with 52 writes left; a local run under load queued 1,300 copies
        # of 1,000 writes); a queue where nothing is confirmed for a minute may not.
        try:
            producer.drain(timeout=300, resend_every=6, stall_timeout=60)
        except QueueTimeout as exc:  # say what the queue and the worker were doing
            depth = _queue_depth(str(settings.broker_url))
            tail = log.read_text(errors="replace")[-3000:]
            raise AssertionError(f"{exc}; queue {depth}; worker log ends:\n{tail}") from exc
    finally:
        thread.join(300)
        worker.stop()
    counts = markers(store)
    letters = Counter(f"{x.error_type}: {x.error[:80]}" for x in store.dead_letters.list())
    assert not letters, f"writes dead-lettered: {letters.most_common(3)}"
    assert kills >= 5, "the worker must have been killed mid-stream"
    assert set(counts) == set(keys), f"lost: {len(set(keys) - set(counts))}"
    assert set(counts.values()) == {1}, "a write landed twice"
    for sid in sessions:
        assert [e.seq for e in store.read(sid)] == list(range(1, 251))
