"""Every message a worker receives ends committed, retried or dead-lettered (issue 15).

Real prefork workers (``celery worker`` subprocesses), real Redis, real PostgreSQL; the
journal-facing cases run on SQLite too.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from core import SessionStore, Settings
from core.blobs.files import FileBlobStore
from core.errors import (
    IdempotencyKeyReused,
    InvalidArgument,
    InvalidEvent,
    StorageUnavailable,
    WriteRejected,
)
from core.journal import Journal
from tasks import enqueue_append
from tasks.app import QUEUE, create_app
from tasks.outcomes import (
    DIGEST_HEADER,
    store_outcome,
    stored_outcome,
    write_digest,
    write_task_id,
)
from tasks.producer import Producer
from tasks.results import QueueTimeout
from tests.cli_process import run_cli
from tests.support import (
    DiskFull,
    TcpProxy,
    WorkerProcess,
    queue_worker,
    send_raw,
    settings_env,
    thread_worker,
    wait_for,
)

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def deep(levels: int) -> Any:
    value: Any = "bottom"
    for _ in range(levels):
        value = {"d": value}
    return value


def note(marker: str) -> dict[str, Any]:
    return {"type": "note", "marker": marker}


def child_deaths(log: Path) -> int:
    text = log.read_text(errors="replace")
    return text.count("WorkerLostError") + text.count("exited with 'signal")


def queue_drained(url: str) -> bool:
    client = redis.Redis.from_url(url)
    try:
        return client.llen(QUEUE) == 0 and client.hlen("unacked") == 0
    finally:
        client.close()


@pytest.fixture
def store(queue_settings: Settings) -> Iterator[SessionStore]:
    with SessionStore.from_settings(queue_settings) as s:
        yield s


@pytest.fixture
def app(queue_settings: Settings) -> Celery:
    return create_app(queue_settings)


@pytest.fixture
def prefork(queue_settings: Settings, tmp_path: Path) -> Iterator[Path]:
    """A prefork worker subprocess; yields its log."""
    with queue_worker(queue_settings, tmp_path) as log:
        yield log


@pytest.mark.slow
def test_poison_pill_900_levels_refused_at_enqueue_and_dead_lettered_raw(
    app: Celery, store: SessionStore, prefork: Path, redis_url: str
) -> None:
    sid = store.create_session(tenant_id="acme").id
    pill = [{"type": "note", "value": deep(900)}]
    with pytest.raises(InvalidEvent) as info:
        enqueue_append(sid, pill, idempotency_key="pill", app=app)
    assert info.value.field.startswith("/value/d/d/d")  # the JSON path of the offence
    assert queue_drained(redis_url)  # nothing was published

    raw = send_raw(app, sid, pill, key="pill")
    behind = [enqueue_append(sid, [note(f"after-{i}")], app=app) for i in range(5)]
    with pytest.raises(WriteRejected) as rejected:
        raw.get(timeout=60)
    assert rejected.value.session_id == sid
    assert sorted(h.get(timeout=60).last_seq for h in behind) == [1, 2, 3, 4, 5]
    letters = store.dead_letters.list()
    assert len(letters) == 1 and "nested deeper" in letters[0].error
    assert letters[0].raw_body is not None and letters[0].content_type == "application/json"
    assert child_deaths(prefork) == 0
    wait_for(lambda: queue_drained(redis_url), 20, "the queue to drain")


@pytest.mark.slow
def test_messages_that_never_reach_the_task_are_dead_lettered_verbatim(
    app: Celery, store: SessionStore, prefork: Path, redis_url: str
) -> None:
    sid = store.create_session(tenant_id="acme").id
    wrong_arity = app.send_task("sessionstore.append", args=[sid, [note("x")], None, "k", 5, 6])
    unknown_field = app.send_task(
        "sessionstore.append",
        kwargs={"session_id": sid, "events": [note("y")], "idempotency_key": "k-c", "colour": 1},
    )
    garbage = [
        (b"\xff\xfe not json", "application/json", "binary", {"task": "sessionstore.append"}),
        (b"\x00\x01\x02", "application/x-garbage", "binary", {}),
        (b'{"no": "task"}', "application/json", "utf-8", {}),
        (b"[1, 2", "application/json", "utf-8", {"task": "sessionstore.nope", "id": "t-1"}),
    ]
    with app.connection_for_write() as conn:
        producer = conn.Producer()
        for body, content_type, encoding, headers in garbage:
            producer.publish(
                body,
                exchange="",
                routing_key=QUEUE,
                content_type=content_type,
                content_encoding=encoding,
                headers=headers,
            )
    ok = enqueue_append(sid, [note("fine")], app=app)
    assert ok.get(timeout=60).last_seq == 1
    wait_for(lambda: len(store.dead_letters.list()) >= 6, 60, "six dead letters")
    letters = store.dead_letters.list()
    assert len(letters) == 6
    reasons = " | ".join(letter.error for letter in letters)
    assert "arguments do not fit" in reasons and "colour" in reasons
    raw = {letter.raw_body: letter for letter in letters}
    for body, content_type, encoding, _ in garbage:
        assert raw[body].content_type == content_type
        assert raw[body].content_encoding == encoding
    for result in (wrong_arity, unknown_field):
        meta = app.backend.get_task_meta(result.id)
        assert meta["result"]["status"] == "dead_lettered"
    # found by (session, key) too, as the task stores a write's outcome (invariant 10)
    by_key = stored_outcome(app, sid, "k-c")
    assert by_key is not None and by_key["status"] == "dead_lettered"
    # ... but only when the body named both: not under the letter's "-" placeholder
    assert app.backend.get_task_meta(write_task_id("-", "t-1"))["status"] == "PENDING"
    assert child_deaths(prefork) == 0
    wait_for(lambda: queue_drained(redis_url), 20, "the queue to drain")


# Messages whose body is a valid write but whose headers (or embed) Celery cannot run: each
# made the worker loop, die or drop it (an adversarial review of the queue, stop 39).
_APPEND = "sessionstore.append"
_HOSTILE_HEADERS: dict[str, tuple[dict[str, Any], Any, str]] = {
    # case: (headers beyond the task name and id, the body's embed, the reason kept)
    "no id": ({"id": None}, {}, "id header"),
    "task a list": ({"task": [_APPEND]}, {}, "task header is not a string"),
    "timelimit a string": ({"timelimit": "ab"}, {}, "timelimit header"),
    "timelimit negative": ({"timelimit": [-1, -1]}, {}, "timelimit header"),
    "timelimit past a float": ({"timelimit": [10**400, None]}, {}, "timelimit header"),
    "id not UTF-8": ({"id": "w\ud800"}, {}, "id header"),
    "eta out of range": ({"eta": "0001-01-01T00:00+14:00"}, {}, "eta header is not a time"),
    "eta past the visibility": ({"eta": "9999-01-01T00:00:00+00:00"}, {}, "visibility timeout"),
    "expires passed": ({"expires": "2001-01-01T00:00:00+00:00"}, {}, "never expires"),
    "expires ahead": ({"expires": "2999-01-01T00:00:00+00:00"}, {}, "never expires"),
    "embed a number": ({}, 5, "must be [args, kwargs, embed]"),
    "embed callbacks a number": ({}, {"callbacks": 5}, "embed callbacks"),
}


@pytest.mark.slow
def test_a_write_whose_headers_celery_cannot_run_is_dead_lettered_and_the_worker_goes_on(
    app: Celery, store: SessionStore, prefork: Path, redis_url: str
) -> None:
    """No id (the consumer took Celery's KeyError for a lost connection and read the
    message again for ever, the queue behind it stuck), a task name or time limit of the
    wrong type (the worker died, on every redelivery), an ETA that cannot be converted (the
    write failed and was dropped), one far past the visibility timeout (redelivered while
    it waits), an ``expires`` (dropped as revoked once passed), an embed that is no dict
    (dropped by the pool), a revoked write (acked as revoked): each is kept as a dead
    letter with its reason, none commits, and the worker serves the next write."""
    sid = store.create_session(tenant_id="acme").id
    keys = {case: f"hdr-{i:02d}" for i, case in enumerate([*_HOSTILE_HEADERS, "revoked"])}
    revoked_id = write_task_id(sid, keys["revoked"])

    def worker_knows_it() -> bool:  # a broadcast before the worker listens is lost: again
        app.control.revoke(revoked_id)
        known = app.control.inspect(timeout=1).revoked() or {}
        return any(revoked_id in ids for ids in known.values())

    wait_for(worker_knows_it, 60, "the worker to know the revoked id")
    cases = {**_HOSTILE_HEADERS, "revoked": ({"id": revoked_id}, {}, "revoked")}
    with app.connection_for_write() as conn:
        producer = conn.Producer()
        for case, (headers, embed, _) in cases.items():
            key = keys[case]
            body = [[], {"session_id": sid, "events": [note(key)], "idempotency_key": key}, embed]
            producer.publish(
                json.dumps(body),
                exchange="",
                routing_key=QUEUE,
                content_type="application/json",
                content_encoding="utf-8",
                headers={"task": _APPEND, "id": write_task_id(sid, key), **headers},
            )
    assert enqueue_append(sid, [note("after")], app=app).get(timeout=60).last_seq == 1
    wait_for(lambda: len(store.dead_letters.list()) >= len(cases), 60, "a letter for each")
    letters = store.dead_letters.list()
    assert len(letters) == len(cases)
    for case, (_, _, reason) in cases.items():
        key = keys[case]
        kept = [x for x in letters if x.raw_body is not None and key.encode() in x.raw_body]
        assert len(kept) == 1 and reason in kept[0].error, (case, [x.error for x in kept])
        assert store.journal.find_write(sid, key) is None, case
    log = prefork.read_text(errors="replace")
    assert "Unrecoverable error" not in log and "Connection to broker lost" not in log
    assert child_deaths(prefork) == 0
    wait_for(lambda: queue_drained(redis_url), 20, "the queue to drain")


@pytest.mark.parametrize(
    ("case", "session", "events", "extra"),
    [
        ("lone surrogate in a string", None, [{"type": "n", "t": "a\ud800"}], {}),
        ("lone surrogate in a key", None, [{"type": "n", "k\udc00": 1}], {}),
        ("lone surrogate in the session id", "s\ud800", [note("a")], {}),
        ("NUL in the session id", "s\x00", [note("a")], {}),
        ("NUL in a key", None, [{"type": "n", "a\x00": 1}], {}),
        ("expected_seq above 2^63", None, [note("a")], {"expected_seq": 2**63 + 5}),
        ("events not a list", None, {"type": "n"}, {}),
    ],
)
def test_bad_write_sent_by_name_is_dead_lettered_once(
    app: Celery,
    store: SessionStore,
    case: str,
    session: str | None,
    events: Any,
    extra: dict[str, Any],
) -> None:
    sid = store.create_session(tenant_id="acme").id
    target = session if session is not None else sid
    kwargs = {"expected_seq": extra.get("expected_seq")}
    with pytest.raises(InvalidEvent):  # the door refuses it ...
        enqueue_append(target, events, idempotency_key="bad", app=app, **kwargs)
    with thread_worker(app):  # ... a client that skips the door gets a dead letter
        handle = send_raw(app, target, events, key="bad", **extra)
        with pytest.raises(WriteRejected) as info:
            handle.get(timeout=30)
    assert info.value.error_type == "InvalidEvent", case
    letters = store.dead_letters.list()
    assert len(letters) == 1 and letters[0].id == info.value.dead_letter_id
    assert store.read(sid) == []


def test_same_key_in_two_sessions_gives_two_outcomes(app: Celery, store: SessionStore) -> None:
    a = store.create_session(tenant_id="acme").id
    b = store.create_session(tenant_id="acme").id
    assert write_task_id(a, "k") != write_task_id(b, "k")
    with thread_worker(app):
        in_a = enqueue_append(a, [note("a1"), note("a2")], idempotency_key="k", app=app)
        # B's write expects a head it does not have: rejected, in B only
        in_b = enqueue_append(b, [note("b1")], idempotency_key="k", expected_seq=7, app=app)
        result_a = in_a.get(timeout=30)
        with pytest.raises(WriteRejected) as rejected:
            in_b.get(timeout=30)
    assert (result_a.session_id, result_a.last_seq) == (a, 2)
    assert rejected.value.session_id == b and rejected.value.error_type == "ConcurrencyConflict"
    assert in_a.get(timeout=1) == result_a  # A still reports A's success
    later_a = stored_outcome(app, a, "k")
    later_b = stored_outcome(app, b, "k")
    assert later_a is not None and later_a["status"] == "ok" and later_a["session_id"] == a
    assert later_b is not None and later_b["status"] == "dead_lettered"
    assert later_b["session_id"] == b
    assert [e.seq for e in store.read(b)] == []


# disk full (SQLite) --------------------------------------------------------------------

_FULL = threading.Event()


def _cap_pages(conn: Connection) -> None:
    """While ``_FULL`` is set, a SQLite database cannot grow: "database or disk is full"."""
    if conn.dialect.name != "sqlite":
        return
    if _FULL.is_set():
        pages = conn.exec_driver_sql("PRAGMA page_count").scalar()
        conn.exec_driver_sql(f"PRAGMA max_page_count = {pages}")
    else:
        conn.exec_driver_sql("PRAGMA max_page_count = 1073741823")


@pytest.fixture
def page_cap() -> Iterator[threading.Event]:
    event.listen(Engine, "begin", _cap_pages)
    try:
        yield _FULL
    finally:
        _FULL.clear()
        event.remove(Engine, "begin", _cap_pages)


@pytest.mark.slow
def test_sqlite_disk_full_is_retried_not_acked_and_lands_once_space_is_back(
    sqlite_url: str, redis_url: str, tmp_path: Path, page_cap: threading.Event
) -> None:
    settings = Settings(
        data_dir=tmp_path / "data",
        database_url=sqlite_url,
        broker_url=redis_url,
        result_backend=redis_url,
        task_visibility_timeout=20,  # retries back off at most 5 s
    )
    app = create_app(settings)
    with SessionStore.from_settings(settings) as store, thread_worker(app):
        sid = store.create_session(tenant_id="acme").id
        page_cap.set()
        big = [f"{n:050d}" for n in range(400)]  # 20 kB of short strings: new pages
        handles = [
            enqueue_append(sid, [{"type": "n", "i": i, "p": big}], app=app) for i in range(3)
        ]
        wait_for(lambda: all(h.result.state == "RETRY" for h in handles), 30, "the writes to retry")
        assert store.read(sid) == [] and store.dead_letters.list() == []
        assert all(h.outcome() is None for h in handles)  # no outcome, so not acked
        page_cap.clear()
        results = [h.get(timeout=60) for h in handles]
        events = store.read(sid)
    assert sorted(r.last_seq for r in results) == [1, 2, 3]
    assert sorted(e.payload["i"] for e in events) == [0, 1, 2]  # each once


@pytest.mark.slow
def test_full_blob_disk_is_retried_not_dead_lettered_and_lands_once_space_is_back(
    queue_settings: Settings, store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk under the blob store is transient: the worker retries the write (no
    dead letter, no outcome, so no ack) and it lands once, when there is space again."""
    assert isinstance(store.blobs, FileBlobStore)
    fault = DiskFull(store.blobs.root)
    monkeypatch.setattr(os, "write", fault.write)
    app = create_app(queue_settings.with_overrides(task_visibility_timeout=20))
    with thread_worker(app):
        sid = store.create_session(tenant_id="acme").id
        fault.full.set()
        big = {"type": "message", "message": {"role": "user", "content": "x" * 100_000}}
        handle = enqueue_append(sid, [big], idempotency_key="k-full", app=app)
        wait_for(
            lambda: fault.refused >= 2 and handle.result.state == "RETRY",
            30,
            "the write to be retried",
        )
        assert handle.outcome() is None
        assert store.read(sid) == [] and store.dead_letters.list() == []
        fault.full.clear()
        result = handle.get(timeout=60)
    assert (result.first_seq, result.last_seq, result.replayed) == (1, 1, False)
    assert store.read(sid, rehydrate=True)[0].payload == big
    assert store.dead_letters.list() == []


@pytest.mark.slow
def test_dead_letter_that_cannot_be_written_is_requeued_not_acked(
    queue_settings: Settings, store: SessionStore, pg_url: str, redis_url: str
) -> None:
    """The database is away when a bad write and an undecodable body arrive: neither can
    be dead-lettered, so neither is acked; both are kept once the database is back."""
    proxy = TcpProxy(("127.0.0.1", 5432))
    proxied = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    app = create_app(
        queue_settings.with_overrides(database_url=proxied, task_visibility_timeout=20)
    )
    sid = store.create_session(tenant_id="acme").id
    try:
        with thread_worker(app):
            warm = enqueue_append(sid, [note("warm")], app=app)  # connections pooled
            warm.get(timeout=30)
            proxy.cut()
            bad = send_raw(app, sid, [{"type": 1}], key="bad-while-down")
            with app.connection_for_write() as conn:
                conn.Producer().publish(
                    b"\x00garbage",
                    exchange="",
                    routing_key=QUEUE,
                    content_type="application/json",
                    content_encoding="binary",
                    headers={"task": "sessionstore.append", "id": "garbage-1"},
                )
            wait_for(lambda: bad.result.state == "RETRY", 30, "the bad write to be retried")
            assert bad.outcome() is None and not queue_drained(redis_url)
            proxy.restore()
            with pytest.raises(WriteRejected):
                bad.get(timeout=60)
            wait_for(lambda: len(store.dead_letters.list()) == 2, 60, "both dead letters")
            wait_for(lambda: queue_drained(redis_url), 30, "the queue to drain")
    finally:
        proxy.cut()
    letters = store.dead_letters.list()
    assert sorted(x.idempotency_key for x in letters) == ["bad-while-down", "garbage-1"]


def test_a_write_with_no_worker_times_out_typed_and_is_still_delivered(
    app: Celery, store: SessionStore, queue_settings: Settings, tmp_path: Path
) -> None:
    """``get`` past its timeout raises ``NotFinishedInTime`` (a SessionStoreError that is
    also the builtin and Celery ``TimeoutError``); the write stays queued and lands once a
    worker runs."""
    from celery.exceptions import TimeoutError as CeleryTimeoutError

    from core.errors import NotFinishedInTime, SessionStoreError

    sid = store.create_session(tenant_id="acme").id
    handle = enqueue_append(sid, [note("waiting")], idempotency_key="k", app=app)
    with pytest.raises(NotFinishedInTime) as info:
        handle.get(timeout=0.3)
    assert isinstance(info.value, SessionStoreError)
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, CeleryTimeoutError)
    assert "not finished after 0.3s" in str(info.value)
    assert store.read(sid) == []

    env = settings_env(
        database_url=str(queue_settings.database_url),
        broker_url=str(queue_settings.broker_url),
        data_dir=tmp_path / "w",
    )
    worker = WorkerProcess(env, tmp_path / "worker.log")
    try:
        assert handle.get(timeout=60).last_seq == 1
    finally:
        worker.stop()
    assert [e.payload["marker"] for e in store.read(sid)] == ["waiting"]


def test_a_key_reused_for_other_content_is_refused_typed_and_the_write_kept(
    app: Celery, store: SessionStore, prefork: Path, redis_url: str
) -> None:
    """A producer that sends other content under a key that committed was answered with
    that commit (Celery's result for the key), and the worker took the write for a replay:
    both said committed, and the content was gone. Now the producer's wait raises
    ``IdempotencyKeyReused`` (the outcome names other content), and the worker refuses
    the write into a dead letter, from where it replays under a new key."""
    sid = store.create_session(tenant_id="acme").id
    first = enqueue_append(sid, [note("first")], idempotency_key="k", app=app).get(timeout=60)
    reused = enqueue_append(sid, [note("other")], idempotency_key="k", app=app)
    with pytest.raises(IdempotencyKeyReused) as caught:
        reused.get(timeout=60)
    assert (caught.value.first_seq, caught.value.last_seq) == (first.first_seq, first.last_seq)
    assert reused.outcome() is not None and reused.outcome()["status"] == "key_reused"
    wait_for(lambda: len(store.dead_letters.list()) == 1, 60, "the worker's dead letter")
    (letter,) = store.dead_letters.list()
    assert (letter.error_type, letter.idempotency_key) == ("IdempotencyKeyReused", "k")
    assert letter.events == [note("other")]
    # the write that committed is still answered as itself, sent again by anyone
    again = enqueue_append(sid, [note("first")], idempotency_key="k", app=app)
    assert again.get(timeout=60).last_seq == first.last_seq
    # a client that sends no digest cannot tell; the worker still keeps its write
    raw = send_raw(app, sid, [note("raw")], key="k")
    assert raw.get(timeout=60).last_seq == first.last_seq
    wait_for(lambda: len(store.dead_letters.list()) == 2, 60, "the raw write's dead letter")
    landed = store.dead_letters.replay(letter.id, store.append, idempotency_key="k-2")
    assert [e.payload["marker"] for e in store.read(sid)] == ["first", "other"]
    assert landed.first_seq == 2
    wait_for(lambda: queue_drained(redis_url), 20, "the queue to drain")
    assert child_deaths(prefork) == 0


def test_a_rejection_of_other_content_is_not_a_writes_answer(
    app: Celery, store: SessionStore
) -> None:
    """The outcome stored under (session, key) can be another write's: a rejection of other
    content sent under the key says nothing of this write (no answer yet), and a resend
    clears it, as Celery would never store this write's outcome over it."""
    sid = store.create_session(tenant_id="acme").id
    handle = enqueue_append(sid, [note("mine")], idempotency_key="k", app=app)
    foreign = {
        "status": "dead_lettered",
        "dead_letter_id": 9,
        "session_id": sid,
        "idempotency_key": "k",
        "error_type": "ConcurrencyConflict",
        "error": "another write's",
        "digest": "f" * 32,
    }
    store_outcome(app, sid, "k", foreign)
    assert handle.outcome() is None
    handle.resend()  # before any worker ran: two messages now, one write
    with thread_worker(app):
        result = handle.get(timeout=30)
    assert result.last_seq == 1 and [e.payload["marker"] for e in store.read(sid)] == ["mine"]
    stored = stored_outcome(app, sid, "k")
    assert stored is not None and stored["status"] == "ok"
    assert handle.digest is not None and stored["digest"] == handle.digest


def test_a_commit_stands_over_a_rejection_of_the_same_write_stored_before(
    app: Celery, store: SessionStore
) -> None:
    """A client sends a write twice (no clearing between: a plain Celery client, or a
    producer's resend before the first outcome). The first delivery is rejected (a stale
    expected_seq then), the second commits once the earlier write is in: Celery never
    stores a result over the rejection, so the commit was answered as rejected."""
    sid = store.create_session(tenant_id="acme").id
    write = [note("second")]
    first = enqueue_append(sid, write, expected_seq=1, idempotency_key="k", app=app)
    with thread_worker(app, concurrency=1):
        with pytest.raises(WriteRejected):
            first.get(timeout=30)
        store.append(sid, [note("first")])
        headers = {DIGEST_HEADER: write_digest(write)}
        again = send_raw(app, sid, write, key="k", headers=headers, expected_seq=1)

        def markers() -> list[str]:
            return [e.payload["marker"] for e in store.read(sid)]

        wait_for(lambda: markers() == ["first", "second"], 30, "the second send to commit")
        wait_for(lambda: (stored_outcome(app, sid, "k") or {}).get("status") == "ok", 30, "ok")
    for handle in (again, first):  # both answered by the commit now
        result = handle.get(timeout=1)
        assert (result.first_seq, result.last_seq) == (2, 2)
    assert markers() == ["first", "second"]


def test_a_rejection_is_stored_whole_before_the_journal_is_asked(
    app: Celery, store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rejected delivery asks the journal for a commit of its key once more after the
    last store of its rejection: a commit after that asking clears the rejection itself.
    Celery stored the rejection again after the asking (the task's return value), over a
    commit that had cleared the first copy."""
    calls: list[str] = []
    backend_type = type(app.backend)
    real_store = backend_type.store_result

    def store_result(self: Any, task_id: str, result: Any, state: str, *a: Any, **kw: Any) -> Any:
        if isinstance(result, dict) and result.get("status") == "dead_lettered":
            calls.append("rejection stored")
        return real_store(self, task_id, result, state, *a, **kw)

    real_lookup = Journal.find_write

    def find_write(self: Journal, session_id: str, key: str) -> Any:
        if key == "k":
            calls.append("asked")
        return real_lookup(self, session_id, key)

    monkeypatch.setattr(backend_type, "store_result", store_result)
    monkeypatch.setattr(Journal, "find_write", find_write)
    sid = store.create_session(tenant_id="acme").id
    handle = enqueue_append(sid, [note("late")], expected_seq=3, idempotency_key="k", app=app)
    with thread_worker(app, concurrency=1):
        with pytest.raises(WriteRejected):
            handle.get(timeout=30)
        wait_for(lambda: calls[-1:] == ["asked"], 30, "the journal to be asked after")
    assert "rejection stored" in calls
    last_store = max(i for i, call in enumerate(calls) if call == "rejection stored")
    assert "asked" in calls[last_store:], calls
    assert calls.index("asked") < calls.index("rejection stored"), calls  # and before


def test_a_rejection_of_invalid_content_under_a_committed_key_answers_with_the_commit(
    app: Celery, store: SessionStore
) -> None:
    """A key committed (here through the library, which stores no outcome), then content
    no write could hold sent under it by a plain client: the outcome under (session, key)
    is the key's commit, so its producer is answered (it was the invalid content's
    rejection, and the commit's producer waited for an answer that never came)."""
    sid = store.create_session(tenant_id="acme").id
    mine = [note("mine")]
    store.append(sid, mine, idempotency_key="k")
    with thread_worker(app, concurrency=1):
        send_raw(app, sid, [{"type": 5}], key="k")
        wait_for(lambda: stored_outcome(app, sid, "k") is not None, 30, "an outcome")
    stored = stored_outcome(app, sid, "k")
    assert stored is not None and stored["status"] == "ok", stored
    assert stored["digest"] == write_digest(mine) and stored["first_seq"] == 1
    assert len(store.dead_letters.list()) == 1  # the invalid content is kept


def test_a_producer_keeps_a_bounded_number_of_outcomes(app: Celery, store: SessionStore) -> None:
    """A producer that runs for ever kept every outcome it saw: now the newest
    ``keep_confirmed``, and ``pop_confirmed`` drains them; pending writes are never dropped."""
    sid = store.create_session(tenant_id="acme").id
    producer = Producer(app, keep_confirmed=2)
    handles = [producer.append(sid, [note(f"n{i}")]) for i in range(4)]
    for i, handle in enumerate(handles[:3]):
        store_outcome(app, sid, handle.idempotency_key, {"status": "ok", "n": i})
        assert producer.poll() == 3 - i  # the fourth has no outcome: still pending
    assert [o["n"] for o in producer.confirmed().values()] == [1, 2]
    assert producer.unconfirmed() == [handles[3]]
    assert [o["n"] for o in producer.pop_confirmed().values()] == [1, 2]
    assert producer.confirmed() == {} and producer.poll() == 1
    with pytest.raises(InvalidEvent):
        Producer(app, keep_confirmed=-1)


def test_resends_of_one_write_back_off(app: Celery, store: SessionStore, redis_url: str) -> None:
    """A write still unconfirmed is resent after ``confirm_timeout``, then after twice as
    long, four times, ... up to 16 times. Before, every call resent every write older than
    the timeout: a queue that was behind (a loaded machine, a worker restarting) got one
    more copy of each pending write per call, which put it further behind (a crash-loop run
    in CI ended with 52 writes unconfirmed after a 90 s drain behind 1,300 queued copies)."""
    sid = store.create_session(tenant_id="acme").id
    producer = Producer(app, confirm_timeout=10)
    handles = [producer.append(sid, [note(f"n{i}")], idempotency_key=f"k{i}") for i in range(5)]
    client = redis.Redis.from_url(redis_url)

    def resent_after(seconds: float) -> int:
        for handle in handles:
            handle.sent_at -= seconds  # as if that long had passed since its last send
        return producer.resend_unconfirmed()

    try:
        assert resent_after(9) == 0 and resent_after(1) == 5  # first resend: at 1x
        assert resent_after(10) == 0  # fails before: 5 more copies
        assert resent_after(10) == 5  # second: at 2x
        assert resent_after(39) == 0 and resent_after(1) == 5  # third: at 4x
        for handle in handles:
            handle.resends = 50
        assert resent_after(159) == 0 and resent_after(1) == 5  # capped at 16x
        assert client.llen(QUEUE) == 5 * 5
    finally:
        client.close()
    with thread_worker(app):
        producer.drain(timeout=60)
    # each once (25 copies of 5 writes with no expected_seq: in any order)
    assert sorted(e.payload["marker"] for e in store.read(sid)) == [f"n{i}" for i in range(5)]


def test_a_write_resent_for_ever_goes_on_being_resent(
    app: Celery, store: SessionStore, redis_url: str
) -> None:
    """The backoff's power was taken before its cap: 2.0**1024 overflowed, and from then on
    no write was resent (about 5.7 days of one write unconfirmed at the default timeout)."""
    sid = store.create_session(tenant_id="acme").id
    producer = Producer(app, confirm_timeout=1)
    old = producer.append(sid, [note("old")], idempotency_key="old")
    old.resends, old.sent_at = 5000, old.sent_at - 16
    new = producer.append(sid, [note("new")], idempotency_key="new")
    new.sent_at -= 1
    assert producer.resend_unconfirmed() == 2  # fails before: OverflowError
    assert (old.resends, new.resends) == (5001, 1)


def test_two_threads_resending_at_once_send_a_write_once(
    app: Celery, store: SessionStore, redis_url: str
) -> None:
    """Each due write is claimed under the producer's lock before it is sent: two threads
    that call ``resend_unconfirmed`` together sent each due write once per thread."""
    sid = store.create_session(tenant_id="acme").id
    producer = Producer(app, confirm_timeout=1)
    handles = [producer.append(sid, [note(f"n{i}")], idempotency_key=f"k{i}") for i in range(20)]
    for handle in handles:
        handle.sent_at -= 1
    barrier = threading.Barrier(2)
    counts: list[int] = []

    def resend() -> None:
        barrier.wait()
        counts.append(producer.resend_unconfirmed())

    threads = [threading.Thread(target=resend) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    client = redis.Redis.from_url(redis_url)
    try:
        assert sum(counts) == 20 and client.llen(QUEUE) == 40  # 20 sent, 20 resent
    finally:
        client.close()
    assert {h.resends for h in handles} == {1}


def test_a_resend_the_broker_refuses_leaves_the_writes_not_resent_due(
    app: Celery, store: SessionStore
) -> None:
    """Due writes are claimed (their send time moved on) before they are sent: when the
    broker refuses one, it and those after it are due again as they were, and the error
    reaches the caller; the one sent before stays sent."""
    sid = store.create_session(tenant_id="acme").id
    producer = Producer(app, confirm_timeout=1)
    handles = [producer.append(sid, [note(f"n{i}")], idempotency_key=f"k{i}") for i in range(3)]
    for handle in handles:
        handle.sent_at -= 5
    was = [h.sent_at for h in handles]

    def refused() -> Any:
        raise StorageUnavailable("broker", "connection refused")

    send, handles[1]._send = handles[1]._send, refused  # type: ignore[method-assign]
    with pytest.raises(StorageUnavailable):
        producer.resend_unconfirmed()  # in the order they were sent: the second is refused
    assert [h.resends for h in handles] == [1, 0, 0]
    assert [h.sent_at for h in handles[1:]] == was[1:]
    handles[1]._send = send  # type: ignore[method-assign]
    assert producer.resend_unconfirmed() == 2  # both due again at once


def test_a_drain_resends_a_lost_write_before_it_gives_up(
    app: Celery, store: SessionStore, redis_url: str
) -> None:
    """A write resent three times waits 8x the timeout for its next resend; a drain whose
    stall limit is shorter gave up on it without resending it, though a worker was there
    to take it (its copies lost: a killed worker's). Within a drain, a write is resent at
    least every half stall limit."""
    sid = store.create_session(tenant_id="acme").id
    producer = Producer(app, confirm_timeout=1)
    handle = producer.append(sid, [note("lost")], idempotency_key="k")
    client = redis.Redis.from_url(redis_url)
    try:
        for _ in range(3):  # the send and each resend lost
            client.delete(QUEUE)
            handle.sent_at -= 100
            producer.resend_unconfirmed()
        client.delete(QUEUE)
    finally:
        client.close()
    assert handle.resends == 3
    with thread_worker(app):
        producer.drain(timeout=60, stall_timeout=2)  # fails before: QueueTimeout after 2 s
    assert [e.payload["marker"] for e in store.read(sid)] == ["lost"]


def test_a_drain_waits_on_a_queue_that_moves_and_not_on_one_that_does_not(
    app: Celery, store: SessionStore
) -> None:
    """``drain(stall_timeout=...)`` gives up once no write was confirmed for that long,
    however long ``timeout`` is; writes confirmed slowly but steadily keep it waiting."""
    sid = store.create_session(tenant_id="acme").id
    producer = Producer(app, confirm_timeout=3600)
    handles = [producer.append(sid, [note(f"n{i}")], idempotency_key=f"k{i}") for i in range(6)]
    started = time.monotonic()
    with pytest.raises(QueueTimeout, match="6 writes not confirmed, none for 1 s"):
        producer.drain(timeout=600, stall_timeout=1)
    assert time.monotonic() - started < 10

    def confirm_slowly() -> None:  # one every 0.4 s: 2.4 s in all, more than the stall limit
        for i, handle in enumerate(handles):
            time.sleep(0.4)
            store_outcome(app, sid, handle.idempotency_key, {"status": "ok", "n": i})

    thread = threading.Thread(target=confirm_slowly)
    thread.start()
    try:
        producer.drain(timeout=600, stall_timeout=1)
    finally:
        thread.join()
    assert len(producer.confirmed()) == 6 and time.monotonic() - started < 30
    for bad in ({"timeout": math.nan}, {"timeout": 1, "stall_timeout": -1}):
        with pytest.raises(InvalidArgument):
            producer.drain(**bad)
    with pytest.raises(InvalidArgument):
        producer.resend_unconfirmed(older_than=math.inf)
    with pytest.raises(InvalidArgument):
        Producer(app, confirm_timeout="3")  # type: ignore[arg-type]


def test_a_key_a_client_without_digests_committed_refuses_other_content(
    app: Celery, store: SessionStore, prefork: Path
) -> None:
    """A ``send_task`` client sends no digest: the worker computes it for the outcome, so
    a producer that later sends other content under that key is refused, not answered
    with the client's commit as its own; and a resend that differs only in how it is
    stored (a transient field, the image as its ref) is the same write."""
    sid = store.create_session(tenant_id="acme").id
    raw = send_raw(app, sid, [note("by name")], key="k")
    committed_by_name = raw.get(timeout=60)
    with pytest.raises(IdempotencyKeyReused):
        enqueue_append(sid, [note("other")], idempotency_key="k", app=app).get(timeout=60)
    same = enqueue_append(sid, [note("by name")], idempotency_key="k", app=app).get(timeout=60)
    assert same.last_seq == committed_by_name.last_seq
    streamed = {**note("streamed"), "partialJson": '{"a":'}
    first = enqueue_append(sid, [streamed], idempotency_key="s", app=app).get(timeout=60)
    resent = {**note("streamed"), "partialJson": '{"a": 1}'}
    again = enqueue_append(sid, [resent], idempotency_key="s", app=app).get(timeout=60)
    assert again.last_seq == first.last_seq
    assert [e.payload["marker"] for e in store.read(sid)] == ["by name", "streamed"]
    wait_for(lambda: len(store.dead_letters.list()) == 1, 60, "the other content's letter")
    assert [x.events for x in store.dead_letters.list()] == [[note("other")]]


HOSTILE_DIGESTS = ["F" * 32, "0" * 31, "0" * 10_000, "", 12345, ["0" * 32], {"d": "0" * 32}, None]


def test_a_hostile_digest_header_is_not_kept(
    app: Celery, store: SessionStore, prefork: Path
) -> None:
    """A ``send_task`` client's own ``write_digest`` header that is not a digest is never
    kept in its outcome (it would refuse the write's own resend, or answer for other
    content): the worker computes the digest of what it committed, as for no header."""
    sid = store.create_session(tenant_id="acme").id
    for n, header in enumerate(HOSTILE_DIGESTS):
        key = f"k{n}"
        raw = send_raw(app, sid, [note(key)], key=key, headers={"write_digest": header})
        assert raw.get(timeout=60).last_seq == n + 1
        stored = stored_outcome(app, sid, key)
        assert stored is not None and stored["digest"] == write_digest([note(key)]), header
        same = enqueue_append(sid, [note(key)], idempotency_key=key, app=app)
        assert same.get(timeout=60).last_seq == n + 1
        with pytest.raises(IdempotencyKeyReused):
            enqueue_append(sid, [note("other")], idempotency_key=key, app=app).get(timeout=60)
    assert child_deaths(prefork) == 0


@pytest.mark.slow
def test_the_demo_on_a_deployment_writes_its_session_in_order(
    store: SessionStore, queue_settings: Settings, prefork: Path, tmp_path: Path
) -> None:
    """``demo --use-settings`` with two pool processes (the compose worker's shape): each
    entry comes after the one it follows. The demo queued every turn at once, and the two
    processes committed them in any order (a conversation without its user turn at seq 6)."""
    env = settings_env(
        database_url=str(queue_settings.database_url),
        broker_url=str(queue_settings.broker_url),
        data_dir=tmp_path / "cli",
    )
    done = run_cli("demo", "--use-settings", "--yes", "--json", env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    session_id = json.loads(done.stdout)["session_id"]
    seen: set[str] = set()
    for stored in store.read(session_id):
        parent = stored.payload.get("parentId")
        assert parent is None or parent in seen, (stored.seq, parent, sorted(seen))
        if isinstance(stored.payload.get("id"), str):
            seen.add(stored.payload["id"])
    assert len(seen) >= 8
