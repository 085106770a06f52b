"""The queue under Celery's time limits, and a producer's answers (invariants 8 and 10).

A prefork worker (time limits need one) with the visibility timeout at 10 s: a soft limit
of 4 s, a hard limit of 5 s. A write held up past a limit is not lost and not rejected:
cut short at the soft limit it is retried; killed at the hard limit (stuck in C, where the
soft one cannot reach it) its message goes back to the queue instead of being acked with
a FAILURE, Celery's default. And what a producer is answered is this send's outcome.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery

from core import SessionStore, Settings
from core.errors import StorageUnavailable
from core.migrate import upgrade
from tasks import WriteRejected, enqueue_append
from tasks.app import celery_config, create_app
from tasks.outcomes import stored_outcome
from tests.support import WorkerProcess, settings_env, thread_worker, wait_for

pytestmark = [pytest.mark.redis]

VISIBILITY = 10


def _event(marker: str) -> dict[str, Any]:
    return {"type": "message", "marker": marker, "message": {"role": "user", "content": marker}}


def _markers(store: SessionStore, session_id: str) -> list[str]:
    return [e.payload["marker"] for e in store.read(session_id)]


@pytest.fixture
def limited(redis_url: str, tmp_path: Path) -> Iterator[tuple[Settings, Path]]:
    """Settings with the time limits at 4 s (soft) and 5 s (hard), and the test's directory."""
    settings = Settings(
        data_dir=tmp_path / "data",
        broker_url=redis_url,
        result_backend=redis_url,
        task_visibility_timeout=VISIBILITY,
    )
    config = celery_config(settings)
    assert (config["task_soft_time_limit"], config["task_time_limit"]) == (4, 5)
    yield settings, tmp_path


def _worker(settings: Settings, database_url: str, tmp_path: Path, **env: str) -> WorkerProcess:
    base = settings_env(
        database_url=database_url,
        broker_url=str(settings.broker_url),
        data_dir=tmp_path / "w",
        visibility_timeout=VISIBILITY,
    )
    faults = "tests.faults" if "SS_TASK_FAULTS" in env else None
    return WorkerProcess({**base, **env}, tmp_path / "worker.log", concurrency=1, include=faults)


def _logged(tmp_path: Path, text: str) -> None:
    """Wait until the worker's log says ``text`` (the lock stays held until it does)."""
    log = tmp_path / "worker.log"
    wait_for(lambda: log.exists() and text in log.read_text(), 90, repr(text), step=0.2)


@contextmanager
def _warm_worker(
    settings: Settings, database_url: str, tmp_path: Path, **env: str
) -> Iterator[tuple[Celery, SessionStore, str]]:
    """A prefork worker on ``database_url`` whose pool process has its store open (a first
    write landed), the app, a store and a session; the worker stops on exit."""
    settings = settings.with_overrides(database_url=database_url)
    app = create_app(settings)
    worker = _worker(settings, database_url, tmp_path, **env)
    with SessionStore.from_settings(settings) as store:
        sid = store.create_session(tenant_id="acme").id
        try:
            enqueue_append(sid, [_event("warm")], app=app).get(timeout=60)
            yield app, store, sid
        finally:
            worker.stop()


def test_a_write_killed_at_the_hard_limit_is_requeued_not_lost(
    limited: tuple[Settings, Path],
) -> None:
    settings, tmp_path = limited
    database = tmp_path / "journal.db"
    url = f"sqlite:///{database}"
    upgrade(url)
    with _warm_worker(settings, url, tmp_path) as (app, store, sid):
        # SQLite's busy wait is in C: the soft limit's signal waits for it, and the hard
        # limit kills the pool process at 5 s, mid-write.
        lock = sqlite3.connect(database, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")
        handle = enqueue_append(sid, [_event("held")], idempotency_key="k-held", app=app)
        _logged(tmp_path, "Hard time limit")  # killed mid-write, however slow the pickup
        lock.execute("ROLLBACK")
        lock.close()
        result = handle.get(timeout=60)  # the FAILURE stored at the kill is not an answer
        assert (result.first_seq, result.last_seq) == (2, 2)
        assert _markers(store, sid) == ["warm", "held"]
        assert store.dead_letters.count() == 0
    assert "Hard time limit" in (tmp_path / "worker.log").read_text()


@pytest.mark.slow
def test_a_write_killed_at_the_hard_limit_every_time_is_dead_lettered_not_run_forever(
    limited: tuple[Settings, Path],
) -> None:
    """Requeued at each kill, a write stuck every time ran again after every visibility
    timeout, for ever, holding a pool process to the hard limit each time. Its deliveries
    are counted (Redis marks a restored message), and past the limit it is dead-lettered,
    typed, without running again."""
    settings, tmp_path = limited
    database = tmp_path / "journal.db"
    url = f"sqlite:///{database}"
    upgrade(url)
    with _warm_worker(settings, url, tmp_path, SESSIONSTORE_TASK_MAX_DELIVERIES="2") as (
        app,
        store,
        sid,
    ):
        lock = sqlite3.connect(database, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")
        handle = enqueue_append(sid, [_event("stuck")], idempotency_key="k-stuck", app=app)
        log = tmp_path / "worker.log"
        wait_for(
            lambda: log.read_text().count("Hard time limit") >= 2, 90, "a second kill", step=0.2
        )
        lock.execute("ROLLBACK")  # a third delivery would now commit: it is not run
        lock.close()
        with pytest.raises(WriteRejected) as rejected:
            handle.get(timeout=60)
        assert rejected.value.error_type == "DeliveriesExhausted"
        assert "delivered 3 times" in rejected.value.reason
        assert _markers(store, sid) == ["warm"]
        (letter,) = store.dead_letters.list()
        assert (letter.idempotency_key, letter.events) == ("k-stuck", [_event("stuck")])
        # the letter lands when replayed, once
        store.dead_letters.replay(letter.id, store.append)
        assert _markers(store, sid) == ["warm", "stuck"]
    assert log.read_text().count("Hard time limit") == 2


@pytest.mark.postgres
def test_a_write_cut_short_by_the_soft_limit_is_retried_not_rejected(
    limited: tuple[Settings, Path], pg_url: str
) -> None:
    settings, tmp_path = limited
    with _warm_worker(settings, pg_url, tmp_path) as (app, store, sid):
        plain_url = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
        with psycopg.connect(plain_url) as lock:
            lock.execute("LOCK TABLE events IN EXCLUSIVE MODE")  # appends wait (in Python)
            handle = enqueue_append(sid, [_event("held")], idempotency_key="k-soft", app=app)
            _logged(tmp_path, "transient failure, retrying write")  # cut short, retried
        result = handle.get(timeout=60)
        assert (result.first_seq, result.last_seq) == (2, 2)
        # the pool process's connection, interrupted mid-statement, was not reused stuck
        after = enqueue_append(sid, [_event("after")], app=app).get(timeout=60)
        assert after.last_seq == 3
        assert _markers(store, sid) == ["warm", "held", "after"]
        assert store.dead_letters.count() == 0
    log = (tmp_path / "worker.log").read_text()
    assert "Soft time limit" in log and "transient failure, retrying write" in log


@pytest.mark.postgres
def test_a_write_cut_short_after_its_commit_is_answered_as_committed(
    limited: tuple[Settings, Path],
) -> None:
    """The soft limit after the commit, before the outcome was stored (metrics, clearing an
    earlier rejection, storing the result): it escaped as the write's FAILURE, acked, and
    the producer was told ``SoftTimeLimitExceeded`` for a write that landed. Now it runs
    again, and the key answers it."""
    settings, tmp_path = limited
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    upgrade(url)
    armed = tmp_path / "faults"
    armed.mkdir()
    with _warm_worker(settings, url, tmp_path, SS_TASK_FAULTS=str(armed)) as (app, store, sid):
        (armed / "slow_after_commit").touch()
        handle = enqueue_append(sid, [_event("late")], idempotency_key="k-late", app=app)
        result = handle.get(timeout=60)
        assert (armed / "slow_after_commit.used").exists()
        assert (result.first_seq, result.last_seq) == (2, 2) and result.replayed
        assert _markers(store, sid) == ["warm", "late"]
        assert store.dead_letters.count() == 0


def test_a_send_is_answered_with_its_own_outcome(queue_settings: Settings) -> None:
    app = create_app(queue_settings)
    with SessionStore.from_settings(queue_settings) as store, thread_worker(app, concurrency=1):
        sid = store.create_session(tenant_id="acme").id
        with pytest.raises(WriteRejected):  # expected head 5 of an empty session: a conflict
            enqueue_append(sid, [_event("a")], expected_seq=5, idempotency_key="k", app=app).get()
        # The same key without the stale expectation: this write commits, and is answered
        # as committed, not with the rejection stored under (session, key) before.
        result = enqueue_append(sid, [_event("a")], idempotency_key="k", app=app).get()
        assert (result.first_seq, result.replayed) == (1, False)
        outcome = stored_outcome(app, sid, "k")
        assert outcome is not None and outcome["status"] == "ok"
        assert _markers(store, sid) == ["a"]


def test_an_unreachable_broker_is_storage_unavailable(tmp_path: Path) -> None:
    dead = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    settings = Settings(
        data_dir=tmp_path, broker_url=dead, result_backend=dead, publish_retry_seconds=0.5
    )
    app = create_app(settings)
    failed: list[BaseException] = []

    def send() -> None:
        try:
            enqueue_append("0e0e0e0e-0000-4000-8000-000000000000", [_event("x")], app=app)
        except BaseException as exc:
            failed.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    sender.join(60)
    assert not sender.is_alive()
    [error] = failed
    assert isinstance(error, StorageUnavailable) and error.component == "broker", repr(error)
