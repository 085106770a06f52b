"""The queue path with a real worker, real Redis and real PostgreSQL (invariants 2, 5, 8)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy import func, select, text

from core import SessionStore, Settings
from core.errors import DeadLetterNotFound, IdempotencyKeyReused, InvalidEvent, WriteTooLarge
from core.models import EventRow
from tasks import WriteRejected, enqueue_append
from tasks.app import create_app
from tasks.embedded import embedded_worker
from tasks.outcomes import write_task_id
from tasks.retry import backoff_seconds, is_transient
from tests.support import (
    SupervisedWorker,
    TcpProxy,
    WorkerProcess,
    queue_worker,
    redis_server,
    send_raw,
    settings_env,
    thread_worker,
    wait_for,
)

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def _event(marker: str) -> dict[str, Any]:
    return {"type": "message", "marker": marker, "message": {"role": "user", "content": marker}}


def _markers(store: SessionStore) -> list[str]:
    with store.engine.connect() as conn:
        rows = conn.execute(text("SELECT payload FROM events ORDER BY position")).scalars()
        payloads = [json.loads(r) if isinstance(r, str) else r for r in rows]  # SQLite: text
        return [p["marker"] for p in payloads if "marker" in p]


def _event_count(store: SessionStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(EventRow)).scalar_one())


def _assert_gapless(store: SessionStore, session_ids: list[str]) -> None:
    for sid in session_ids:
        seqs = [e.seq for e in store.read(sid)]
        assert seqs == list(range(1, len(seqs) + 1))


@pytest.fixture
def store(queue_settings: Settings) -> Iterator[SessionStore]:
    with SessionStore.from_settings(queue_settings) as s:
        yield s


@pytest.fixture
def app(queue_settings: Settings) -> Celery:
    return create_app(queue_settings)


@pytest.fixture
def worker(app: Celery) -> Iterator[None]:
    with thread_worker(app, concurrency=4):
        yield


def test_four_producers_enqueue_2000_writes(app: Celery, store: SessionStore, worker: None) -> None:
    sessions = [store.create_session(tenant_id="acme").id for _ in range(8)]
    handles: list[Any] = []
    lock = threading.Lock()

    def producer(n: int) -> None:
        for i in range(500):
            h = enqueue_append(sessions[(n + i) % 8], [_event(f"{n}-{i}")], app=app)
            with lock:
                handles.append(h)

    threads = [threading.Thread(target=producer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = [h.get(timeout=120) for h in handles]
    assert len(results) == 2000 and not any(r.replayed for r in results)
    markers = _markers(store)
    assert len(markers) == 2000 and len(set(markers)) == 2000
    _assert_gapless(store, sessions)


def test_same_key_enqueued_twice_writes_once(
    app: Celery, store: SessionStore, worker: None
) -> None:
    sid = store.create_session(tenant_id="acme").id
    batch = [_event("a"), _event("b"), _event("c")]
    first = enqueue_append(sid, batch, idempotency_key="write-1", app=app)
    assert first.id == "write-1" and first.result.id == write_task_id(sid, "write-1")
    r1 = first.get(timeout=30)
    assert (r1.first_seq, r1.last_seq) == (1, 3)
    first.result.forget()  # as if the outcome never reached the producer
    first.resend()  # a producer re-sending an unconfirmed write: the journal dedupes
    assert first.get(timeout=30).replayed
    again = enqueue_append(sid, batch, idempotency_key="write-1", app=app)
    assert again.get(timeout=30) == first.get(timeout=1)
    assert _markers(store) == ["a", "b", "c"]


def test_any_celery_client_can_send_the_task_by_name(
    store: SessionStore, worker: None, redis_url: str
) -> None:
    sid = store.create_session(tenant_id="acme").id
    client = Celery("producer-elsewhere", broker=redis_url, backend=redis_url)
    result = client.send_task(
        "sessionstore.append",
        kwargs={"session_id": sid, "events": [_event("by-name")]},
        queue="sessionstore",
    )
    outcome = result.get(timeout=30)
    assert outcome["status"] == "ok" and outcome["first_seq"] == 1
    assert _markers(store) == ["by-name"]
    client.close()


def test_poison_write_is_dead_lettered_and_the_next_writes_land(
    app: Celery, store: SessionStore, worker: None
) -> None:
    sid = store.create_session(tenant_id="acme").id
    with pytest.raises(InvalidEvent, match="/type"):  # refused at the door, nothing sent
        enqueue_append(sid, [_event("ok"), {"type": 42}], idempotency_key="poison", app=app)
    poison = send_raw(app, sid, [_event("ok"), {"type": 42}], key="poison")
    after = [enqueue_append(sid, [_event(f"after-{i}")], app=app) for i in range(5)]
    with pytest.raises(WriteRejected) as info:
        poison.get(timeout=30)
    assert info.value.error_type == "InvalidEvent" and "/type" in info.value.reason
    assert sorted(h.get(timeout=30).last_seq for h in after) == [1, 2, 3, 4, 5]

    letters = store.dead_letters.list()
    assert len(letters) == 1
    letter = letters[0]
    assert (letter.idempotency_key, letter.session_id) == ("poison", sid)
    assert letter.events == [_event("ok"), {"type": 42}]
    assert "must be a string" in letter.error

    fixed = [_event("ok"), {"type": "label", "label": "fixed"}]
    replayed = store.dead_letters.replay(letter.id, store.append, events=fixed)
    assert (replayed.first_seq, replayed.last_seq) == (6, 7)
    with pytest.raises(DeadLetterNotFound):
        store.dead_letters.replay(letter.id, store.append, events=fixed)
    assert store.append(sid, fixed, idempotency_key="poison").replayed  # the key landed once
    assert _event_count(store) == 7


def test_unknown_session_is_dead_lettered_not_retried(
    app: Celery, store: SessionStore, worker: None
) -> None:
    handle = enqueue_append("no-such-session", [_event("x")], app=app)
    with pytest.raises(WriteRejected, match="SessionNotFound"):
        handle.get(timeout=30)
    assert handle.result.info["status"] == "dead_lettered"


def test_too_large_write_is_refused_at_enqueue(queue_settings: Settings, redis_url: str) -> None:
    app = create_app(queue_settings.with_overrides(max_write_bytes=4096, max_batch_events=3))
    with pytest.raises(WriteTooLarge, match="4,096 bytes"):
        enqueue_append("s", [_event("x" * 5000)], app=app)
    with pytest.raises(WriteTooLarge, match="limit of 3"):
        enqueue_append("s", [_event("x")] * 4, app=app)


def test_database_unavailable_for_seconds_then_every_write_lands(
    queue_settings: Settings, store: SessionStore, pg_url: str
) -> None:
    proxy = TcpProxy(("127.0.0.1", 5432))
    proxied = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    app = create_app(queue_settings.with_overrides(database_url=proxied))
    sid = store.create_session(tenant_id="acme").id
    try:
        with thread_worker(app, concurrency=2):
            first = [enqueue_append(sid, [_event(f"a{i}")], app=app) for i in range(20)]
            for h in first:
                h.get(timeout=30)
            proxy.cut()
            during = [enqueue_append(sid, [_event(f"b{i}")], app=app) for i in range(30)]
            time.sleep(4)
            assert len(_markers(store)) == 20  # nothing lands while the database is away
            proxy.restore()
            for h in during:
                h.get(timeout=90)
    finally:
        proxy.cut()
    markers = _markers(store)
    assert len(markers) == 50 and len(set(markers)) == 50
    _assert_gapless(store, [sid])


def test_embedded_mode_uses_a_real_worker_without_servers(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "embedded")
    from core.migrate import upgrade

    upgrade(settings.resolved_database_url)
    app = create_app(settings)
    assert app.conf.broker_url.startswith("filesystem://")
    with SessionStore.from_settings(settings) as store, embedded_worker(app):
        sid = store.create_session(tenant_id="acme").id
        handles = [enqueue_append(sid, [_event(f"e{i}")], app=app) for i in range(20)]
        assert sorted(h.get(timeout=30).last_seq for h in handles) == list(range(1, 21))
        assert all(not h.result.info.get("replayed") for h in handles)
        assert len(_markers(store)) == 20


def test_retry_policy_classifies_and_caps() -> None:
    from sqlalchemy.exc import IntegrityError, OperationalError

    assert is_transient(OperationalError("x", {}, Exception("server closed the connection")))
    assert is_transient(ConnectionResetError())
    assert not is_transient(SoftTimeLimitExceeded())  # only the write task retries it
    assert not is_transient(IntegrityError("x", {}, Exception("dup")))
    assert not is_transient(ValueError("bad"))
    delays = [backoff_seconds(n, visibility_timeout=40) for n in range(30)]
    assert max(delays) <= 10.0 and min(delays) >= 0.0
    # a long outage: 2.0**1024 overflowed, and the write's retry ended it as a failure
    late = [backoff_seconds(n, visibility_timeout=40) for n in (1023, 1024, 10**6)]
    assert all(0.0 <= d <= 10.0 for d in late)


# crash tests: worker subprocesses killed with SIGKILL -------------------------------------


def _land_every_write(store: SessionStore, handles: dict[str, Any]) -> None:
    """Wait for redelivery (visibility timeout 10 s); then, as a producer does with writes
    it has no confirmation for, re-send the missing ones under their keys. kombu's Redis
    transport can lose a message popped by a worker killed before it recorded it as
    unacked; the re-send covers that, and the keys keep every write exactly once."""
    expected = len(handles)
    try:
        wait_for(lambda: len(_markers(store)) >= expected, 40, "redelivery", step=0.5)
    except AssertionError:
        landed = set(_markers(store))
        for key, handle in handles.items():
            if key not in landed:
                handle.resend()
        wait_for(lambda: len(_markers(store)) >= expected, 60, "every write to land", step=0.5)
    time.sleep(2)  # would-be duplicates have time to show up


@contextmanager
def hanging_after_commit(
    queue_settings: Settings, tmp_path: Path, *, table: str = "events"
) -> Iterator[Path]:
    """A prefork worker with ``tests.faults`` armed: the first transaction that inserts into
    ``table`` hangs after its commit, its process id in ``<faults>/committed``. Yields the
    faults directory; the worker is stopped on the way out."""
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "armed").touch()
    armed = {"SS_FAULT_DIR": str(faults), "SS_FAULT_TABLE": table}
    with queue_worker(queue_settings, tmp_path, include="tests.faults", **armed):
        yield faults


@pytest.mark.slow
def test_message_redelivered_after_worker_killed_mid_task_writes_no_duplicate(
    app: Celery, store: SessionStore, queue_settings: Settings, tmp_path: Path
) -> None:
    with hanging_after_commit(queue_settings, tmp_path) as faults:
        sid = store.create_session(tenant_id="acme").id
        handle = enqueue_append(sid, [_event("x"), _event("y")], idempotency_key="k-crash", app=app)
        wait_for((faults / "committed").exists, 60, "the write to commit and hang before ack")
        assert _markers(store) == ["x", "y"]  # committed, message not yet acked
        assert handle.result.state == "PENDING"  # landed, but no result stored, no ack
        os.kill(int((faults / "committed").read_text()), signal.SIGKILL)
        # The message comes back (reject on worker lost) and its second run answers from
        # the idempotency record: the same seqs, nothing written.
        result = handle.get(timeout=60)
        assert result.replayed and (result.first_seq, result.last_seq) == (1, 2)
    assert _markers(store) == ["x", "y"]


@pytest.mark.slow
def test_worker_killed_after_keeping_a_dead_letter_answers_once_with_one_letter(
    app: Celery, store: SessionStore, queue_settings: Settings, tmp_path: Path
) -> None:
    """Killed between keeping the rejected write and storing its outcome: the message comes
    back, its second run finds the same letter (not a second one) and answers with it."""
    with hanging_after_commit(queue_settings, tmp_path, table="dead_letters") as faults:
        sid = store.create_session(tenant_id="acme").id
        handle = enqueue_append(sid, [_event("late")], expected_seq=5, idempotency_key="k", app=app)
        wait_for((faults / "committed").exists, 60, "the letter to be kept and the task to hang")
        (kept,) = store.dead_letters.list()
        assert handle.result.state == "PENDING"  # kept, but no outcome stored, no ack
        os.kill(int((faults / "committed").read_text()), signal.SIGKILL)
        with pytest.raises(WriteRejected) as rejected:
            handle.get(timeout=60)
    assert rejected.value.error_type == "ConcurrencyConflict"
    assert rejected.value.dead_letter_id == kept.id
    assert [letter.id for letter in store.dead_letters.list()] == [kept.id]
    assert _markers(store) == []


@pytest.mark.parametrize("committed", ["the same write", "other content"])
def test_a_rejection_stored_after_the_key_committed_is_answered_by_the_commit(
    app: Celery, store: SessionStore, queue_settings: Settings, tmp_path: Path, committed: str
) -> None:
    """One delivery of a write is rejected (its expected_seq stale then) and stops between
    keeping the letter and storing its outcome; meanwhile the key commits: the same write
    (another delivery), or other content under it. The rejection, stored last, stood over
    the commit for good: the write's producer was told it was rejected (and might send it
    again as new), or got no answer at all. Now the rejected delivery asks the journal once
    its outcome is stored: the commit answers (``key_reused`` for other content)."""
    with hanging_after_commit(queue_settings, tmp_path, table="dead_letters") as faults:
        sid = store.create_session(tenant_id="acme").id
        write = [_event("second")]
        handle = enqueue_append(sid, write, expected_seq=1, idempotency_key="k", app=app)
        wait_for((faults / "committed").exists, 60, "the rejection to be kept and the task to hang")
        store.append(sid, [_event("first")])
        landed = write if committed == "the same write" else [_event("other")]
        store.append(sid, landed, expected_seq=1, idempotency_key="k")
        (faults / "release").touch()
        if committed == "the same write":
            result = handle.get(timeout=60)
            assert (result.first_seq, result.last_seq) == (2, 2)
        else:
            with pytest.raises(IdempotencyKeyReused) as reused:
                handle.get(timeout=60)
            assert (reused.value.first_seq, reused.value.last_seq) == (2, 2)
    assert _markers(store) == ["first", landed[0]["marker"]]
    assert len(store.dead_letters.list()) == 1  # kept: a replay of it is answered as one


@pytest.mark.slow
def test_sigkill_worker_mid_stream_every_accepted_write_lands_once(
    app: Celery, store: SessionStore, queue_settings: Settings, tmp_path: Path
) -> None:
    env = settings_env(
        database_url=str(queue_settings.database_url),
        broker_url=str(queue_settings.broker_url),
        data_dir=tmp_path / "w",
        visibility_timeout=10,
    )
    app = create_app(queue_settings.with_overrides(task_visibility_timeout=10))
    sessions = [store.create_session(tenant_id="acme").id for _ in range(4)]
    keys = [str(uuid.uuid4()) for _ in range(1000)]
    handles = {  # all queued first: the worker cannot keep up with a slow enqueue and finish
        key: enqueue_append(sessions[i % 4], [_event(key)], idempotency_key=key, app=app)
        for i, key in enumerate(keys)
    }
    first = WorkerProcess(env, tmp_path / "w1.log")
    try:
        progress = "the first worker to make progress"
        wait_for(lambda: _event_count(store) >= 200, 60, progress, step=0.01)
        first.kill()
        landed_at_kill = _event_count(store)
        assert landed_at_kill < 1000, "the stream must still be running when the worker dies"
        second = WorkerProcess(env, tmp_path / "w2.log")
        try:
            _land_every_write(store, handles)
        finally:
            second.stop()
    finally:
        first.kill()
    markers = _markers(store)
    assert sorted(markers) == sorted(keys)  # each accepted write exactly once
    _assert_gapless(store, sessions)


@pytest.mark.slow
def test_broker_killed_and_restarted_mid_stream_loses_no_write(
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
        app = create_app(settings)
        sid = store.create_session(tenant_id="acme").id
        # a worker that loses its broker at an unlucky moment (just started) may give up,
        # exiting non-zero, and its supervisor starts it again
        worker = SupervisedWorker(env, tmp_path / "worker.log")
        accepted: list[str] = []
        handles: dict[str, Any] = {}
        errors: list[BaseException] = []

        def producer(n: int) -> None:
            for i in range(200):
                key = f"p{n}-{i}"
                try:
                    handles[key] = enqueue_append(sid, [_event(key)], idempotency_key=key, app=app)
                except BaseException as exc:  # a refused publish would be a lost write
                    errors.append(exc)
                    return
                accepted.append(key)
                time.sleep(0.005)

        try:
            producers = [threading.Thread(target=producer, args=(n,)) for n in range(3)]
            for t in producers:
                t.start()
            wait_for(lambda: len(accepted) >= 150, 60, "producers to get going")
            broker.kill()
            time.sleep(2)
            broker.start()
            for t in producers:
                t.join(120)
            assert errors == [] and len(accepted) == 600
            _land_every_write(store, handles)
        finally:
            worker.stop()
    assert all(code != 0 for code in worker.exits), f"a worker exited 0: {worker.exits}"
    markers = _markers(store)
    assert sorted(markers) == sorted(accepted)
    _assert_gapless(store, [sid])
