"""``sessionstore worker --metrics-port``: scrape /metrics after a known workload and check
the counters exactly (prefork children counted through prometheus' multiprocess mode)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from core import SessionStore, Settings
from core.errors import WriteRejected
from tasks import enqueue_append
from tasks.app import create_app
from tests.support import free_port, settings_env, spawn, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

BLOB_TEXT = "metrics " * 2_500  # 20,000 bytes: over the inline limit, so a blob


@pytest.fixture
def store(queue_settings: Settings) -> Iterator[SessionStore]:
    with SessionStore.from_settings(queue_settings) as s:
        yield s


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    samples = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def test_scraped_counters_match_the_workload_exactly(
    store: SessionStore, queue_settings: Settings, redis_url: str, tmp_path: Path
) -> None:
    port = free_port()
    env = {
        **os.environ,
        **settings_env(
            database_url=queue_settings.resolved_database_url,
            broker_url=redis_url,
            data_dir=queue_settings.data_dir,
        ),
    }
    cli = str(Path(sys.executable).with_name("sessionstore"))
    args = ["--metrics-port", str(port), "--pool", "prefork", "-c", "2", "-n", "m@%h"]
    log = (tmp_path / "worker.log").open("wb")
    worker = spawn(
        [cli, "worker", *args],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    app = create_app(queue_settings)
    try:
        wait_for(lambda: _reachable(port), 60, "the metrics endpoint")
        sid = store.create_session(tenant_id="acme").id
        writes = 6
        for i in range(writes):  # one at a time: the first put stores the blob, the rest dedup
            event = {"type": "custom", "customType": "m", "n": i, "data": BLOB_TEXT}
            enqueue_append(sid, [event], idempotency_key=f"k{i}", app=app).get(timeout=60)
        dead = 2
        for _ in range(dead):  # a session that does not exist: dead-lettered by the worker
            handle = enqueue_append("no-such-session", [{"type": "n"}], app=app)
            with pytest.raises(WriteRejected):
                handle.get(timeout=60)
        samples = _scrape(port)
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(30)
        log.close()
        app.close()
    committed = samples[("sessionstore_writes_total", (("outcome", "committed"), ("reason", "")))]
    assert committed == writes
    assert _total(samples, "sessionstore_dead_letters_total") == dead
    rejected = [
        v
        for (n, labels), v in samples.items()
        if n == "sessionstore_writes_total" and ("outcome", "rejected") in labels
    ]
    assert sum(rejected) == dead
    assert _total(samples, "sessionstore_events_appended_total") == writes
    assert _total(samples, "sessionstore_blob_bytes_put_total") == len(BLOB_TEXT)
    assert _total(samples, "sessionstore_blob_bytes_deduplicated_total") == (writes - 1) * len(
        BLOB_TEXT
    )
    assert _total(samples, "sessionstore_queue_lag_seconds_count") == writes
    assert _total(samples, "sessionstore_append_seconds_count") == writes


def _reachable(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
    except OSError:
        return False
    return True
