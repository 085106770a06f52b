"""The embedded broker (core.broker): no message read half written, none read twice, and an
unreadable file never stops a worker. kombu's own filesystem transport fails the first and
the last (0 of 40 big messages delivered in the first test; the worker stops consuming in
the last)."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from core import SessionStore, Settings, broker
from core.migrate import upgrade
from tasks import enqueue_append
from tasks.app import celery_config, create_app
from tasks.embedded import embedded_worker
from tests.support import (
    WorkerProcess,
    broker_connection,
    clean_env,
    run_together,
    thread_worker,
    wait_for,
)

_MP = multiprocessing.get_context("spawn")


def _consume(data_dir: str, expected: int, out: Any) -> None:
    got: list[tuple[int, int]] = []
    errors: list[str] = []
    deadline = time.monotonic() + 60
    with broker_connection(Settings(data_dir=Path(data_dir))) as conn:
        queue = conn.SimpleQueue("race")
        while len(got) < expected and time.monotonic() < deadline:
            try:
                message = queue.get(timeout=2)
            except queue.Empty:
                continue
            except Exception as exc:  # what kombu's own transport raises: JSONDecodeError
                errors.append(type(exc).__name__)
                continue
            got.append((message.payload["i"], len(message.payload["rows"])))
            message.ack()
    out.put((got, errors))


def test_a_consumer_never_reads_a_message_while_it_is_being_written(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    assert celery_config(settings)["broker_transport"] == "core.broker:Transport"
    n, rows = 40, [{"k": "x" * 100, "n": i} for i in range(60_000)]  # ~7 MB: slow to encode
    out = _MP.Queue()
    consumer = _MP.Process(target=_consume, args=(str(tmp_path), n, out))
    consumer.start()
    try:
        with broker_connection(settings) as conn:
            queue = conn.SimpleQueue("race")
            for i in range(n):
                queue.put({"i": i, "rows": rows})
        got, errors = out.get(timeout=90)
    finally:
        consumer.join(10)
        consumer.kill()
    assert errors == []
    assert sorted(got) == [(i, len(rows)) for i in range(n)]


def _compete(data_dir: str, ready: Any, go: Any, out: Any) -> None:
    got: list[int] = []
    with broker_connection(Settings(data_dir=Path(data_dir))) as conn:
        queue = conn.SimpleQueue("race")
        ready.put(True)
        go.wait(60)
        idle_since = time.monotonic()
        while time.monotonic() - idle_since < 3:
            try:
                message = queue.get(timeout=0.5)
            except queue.Empty:
                continue
            got.append(message.payload["i"])
            message.ack()
            idle_since = time.monotonic()
    out.put(got)


def test_competing_consumers_each_take_a_message_exactly_once(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    n = 600
    with broker_connection(settings) as conn:
        queue = conn.SimpleQueue("race")
        for i in range(n):
            queue.put({"i": i, "pad": "y" * 2000})
    taken = run_together(_compete, (str(tmp_path),), 3)
    every = sorted(i for got in taken for i in got)
    assert every == list(range(n))  # none lost, none twice
    assert sum(1 for got in taken if got) >= 2  # they did compete


@pytest.mark.parametrize(
    "torn",
    [
        b'{"body": "eyJ',  # cut short: not JSON
        # JSON but no message: each stopped the worker when kombu built its message, and
        # with claims kept until their ack, each next worker too
        b"[1, 2]",
        b'{"body": "x"}',
        b'{"body": "x", "properties": {"body_encoding": "base64"}}',
    ],
    ids=["not-json", "a-list", "no-properties", "no-delivery-tag"],
)
def test_an_unreadable_message_file_is_set_aside_and_the_worker_goes_on(
    tmp_path: Path, torn: bytes
) -> None:
    settings = Settings(data_dir=tmp_path / "embedded")
    upgrade(settings.resolved_database_url)
    app = create_app(settings)
    inbox = Path(app.conf.broker_transport_options["data_folder_in"])
    queue_name = app.conf.task_default_queue
    # Sorted first, as a producer that crashed mid-write with kombu's transport leaves it.
    name = f"1_00000000-0000-0000-0000-000000000000.{queue_name}.msg"
    (inbox / name).write_bytes(torn)
    with SessionStore.from_settings(settings) as store, embedded_worker(app):
        sid = store.create_session(tenant_id="acme").id
        handles = [
            enqueue_append(
                sid, [{"type": "message", "message": {"role": "user", "content": f"m{i}"}}], app=app
            )
            for i in range(5)
        ]
        assert sorted(h.get(timeout=30).last_seq for h in handles) == [1, 2, 3, 4, 5]
    assert not (inbox / name).exists()
    assert (inbox.parent / "bad" / name).read_bytes() == torn


def test_what_is_no_message_file_is_set_aside_unread_and_the_worker_goes_on(
    tmp_path: Path,
) -> None:
    """A directory, a FIFO and a link to a file outside, named as messages in the queue
    folder (by hand, or by a hostile local user): each is set aside in ``bad/`` as it is,
    never read, and the worker goes on (a probe's finding: the directory stopped the worker,
    exit 0 from ``sessionstore worker``; the FIFO hung it, then ``queue status``)."""
    settings = Settings(data_dir=tmp_path / "embedded")
    upgrade(settings.resolved_database_url)
    app = create_app(settings)
    inbox = Path(app.conf.broker_transport_options["data_folder_in"])
    queue_name = app.conf.task_default_queue
    outside = tmp_path / "outside.json"
    outside.write_text('{"not": "yours"}')
    planted = {
        kind: f"{i}_00000000-0000-0000-0000-00000000000{i}.{queue_name}.msg"
        for i, kind in enumerate(("directory", "fifo", "link"), start=1)
    }
    (inbox / planted["directory"]).mkdir()
    os.mkfifo(inbox / planted["fifo"])
    (inbox / planted["link"]).symlink_to(outside)
    with SessionStore.from_settings(settings) as store, embedded_worker(app):
        sid = store.create_session(tenant_id="acme").id
        message = {"type": "message", "message": {"role": "user", "content": "m"}}
        assert enqueue_append(sid, [message], app=app).get(timeout=30).last_seq == 1
    bad = inbox.parent / "bad"
    assert (bad / planted["directory"]).is_dir()
    assert stat.S_ISFIFO(os.lstat(bad / planted["fifo"]).st_mode)
    assert (bad / planted["link"]).is_symlink()
    assert outside.read_text() == '{"not": "yours"}'
    assert not any(inbox.glob(f"*.{queue_name}.msg"))


def test_a_claim_that_is_no_message_file_goes_back_unread(tmp_path: Path) -> None:
    """A lost consumer's claim that is a FIFO goes back to the queue as it is (set aside
    when claimed again), where reading it to count the delivery waited forever."""
    fifo = tmp_path / "claim"
    os.mkfifo(fifo)
    done: list[str] = []
    reader = threading.Thread(target=lambda: done.append(broker._counted(fifo, "1_x.q.msg")))
    reader.daemon = True
    reader.start()
    reader.join(10)
    assert done == ["1_x.q.msg"]


def test_two_data_dirs_in_one_process_each_get_their_own_messages(tmp_path: Path) -> None:
    for name in ("first", "second", "third"):
        with broker_connection(Settings(data_dir=tmp_path / name)) as conn:
            queue = conn.SimpleQueue("race")
            queue.put({"i": name})
            assert queue.get(timeout=5).payload == {"i": name}


def test_a_worker_of_one_command_leaves_no_mailbox_behind(tmp_path: Path) -> None:
    """``append --enqueue`` (and every command that runs a worker of its own) on the
    embedded broker, then ``queue status``: nothing accumulates in the queue
    directory (each command's worker left its remote-control mailbox bound, and every
    status call then wrote two messages per dead mailbox that nothing read)."""

    from tests.cli_process import run_cli
    from tests.support import clean_env

    env = clean_env(tmp_path / "data")
    sid = json.loads(run_cli("sessions", "create", "--json", env=env).stdout)["id"]
    events = tmp_path / "e.jsonl"
    events.write_text(json.dumps({"type": "note", "n": 1}) + "\n")
    done = run_cli("append", sid, str(events), "--enqueue", env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    inbox = tmp_path / "data" / "queue" / "in"

    def waiting() -> int:
        return len(list(inbox.iterdir())) if inbox.exists() else 0

    before = waiting()
    run_cli("queue", "status", "--timeout", "0.1", env=env, timeout=60)
    assert waiting() == before == 0


def test_an_embedded_worker_keeps_remote_control_unless_told_and_restores_it(
    tmp_path: Path,
) -> None:
    """Only a command's own worker on the embedded broker goes without a mailbox: one a
    library user runs on Redis (the README's producer guide) stays visible to queue status,
    and the app's setting is what it was once the block ends (it stayed off)."""
    app = create_app(Settings(data_dir=tmp_path / "data"))
    upgrade(f"sqlite:///{tmp_path / 'data' / 'journal.db'}")
    for remote_control in (True, False):
        with embedded_worker(app, remote_control=remote_control) as worker:
            answered = app.control.inspect(timeout=2).ping() or {}
            assert (worker.hostname in answered) is remote_control, answered
        assert app.conf.worker_enable_remote_control is True


def test_acked_requeued_restored_and_no_ack_messages_leave_no_claim(tmp_path: Path) -> None:
    """A claimed message is held in ``claimed/`` until its consumer is done with it: acked
    (gone), rejected to the queue or restored at shutdown (back in the queue, once)."""
    settings = Settings(data_dir=tmp_path)
    claimed = tmp_path / "queue" / "claimed"
    with broker_connection(settings) as conn:
        queue = conn.SimpleQueue("claims")
        for i in range(3):
            queue.put({"i": i})
        acked = queue.get(timeout=5)  # one published in the same millisecond may be first
        acked.ack()
        assert list(claimed.iterdir()) == []
        queue.get(timeout=5).requeue()
        held = queue.get(timeout=5)
        assert held.payload != acked.payload and len(list(claimed.iterdir())) == 1
    # closed with 2 unacked: restored, as kombu restores a consumer's unacked messages
    assert list(claimed.iterdir()) == []
    with broker_connection(settings) as conn:
        queue = conn.SimpleQueue("claims", no_ack=True)
        back = sorted(queue.get(timeout=5).payload["i"] for _ in range(2))
        assert back == sorted({0, 1, 2} - {acked.payload["i"]})
        assert list(claimed.iterdir()) == []  # no ack will come: not held
        with pytest.raises(queue.Empty):
            queue.get(timeout=0.5)


def test_a_claim_goes_back_only_when_its_consumer_is_gone(tmp_path: Path) -> None:
    """On this machine a claim is returned once its process no longer runs (a pid reused by
    a later process does not keep it); one made elsewhere (another boot, a volume shared
    with another namespace) after the visibility timeout, as Redis returns a message."""
    claimed, inbox = tmp_path / "claimed", tmp_path / "in"
    claimed.mkdir()
    inbox.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    alive = subprocess.Popen(["sleep", "60"])
    zombie = subprocess.Popen(["sleep", "0"])  # not reaped: /proc still shows it, as Z
    try:
        wait_for(lambda: broker._process_start(alive.pid) is not None, 10, "sleep to start")
        state = Path(f"/proc/{zombie.pid}/stat")
        wait_for(lambda: state.read_text().rsplit(")", 1)[1].split()[0] == "Z", 10, "a zombie")
        zombie_start = state.read_text().rsplit(")", 1)[1].split()[19]
        owners = {
            "zombie": f"{broker._MACHINE}.{zombie.pid}.{zombie_start}",
            "dead": f"{broker._MACHINE}.{gone.pid}.123",
            "reused": f"{broker._MACHINE}.{alive.pid}.1",  # its pid, another start time
            "alive": broker._owner(alive.pid),
            "elsewhere": f"0ther{broker._MACHINE}.{alive.pid}.1",
        }
        for label, owner in owners.items():
            (claimed / f"{owner}~{label}~1_{label}.celery.msg").write_text(label)
        assert broker.reclaim(claimed, inbox, older_than_s=3600) == 3
        assert sorted(p.name for p in inbox.iterdir()) == [
            "1_dead.celery.msg",
            "1_reused.celery.msg",
            "1_zombie.celery.msg",  # dead, its parent not told yet: it kept the claim for ever
        ]
        assert (inbox / "1_dead.celery.msg").read_text() == "dead"
        assert broker.reclaim(claimed, inbox, older_than_s=0) == 1  # elsewhere: by age only
        assert sorted(p.name.rpartition("~")[2] for p in claimed.iterdir()) == [
            "1_alive.celery.msg"
        ]
    finally:
        alive.kill()
        alive.wait()
        zombie.wait()


@pytest.mark.slow
def test_a_worker_killed_mid_task_gets_its_message_back_on_the_embedded_broker(
    tmp_path: Path,
) -> None:
    """A real prefork worker on the embedded defaults, SIGKILLed (main process and pool)
    after its write committed and before the ack: the claimed message was deleted at the
    claim, so the write never got an outcome (the handle waited for ever). Now the next
    worker returns it, and the write is answered from its committed record."""
    data_dir = tmp_path / "data"
    settings = Settings(data_dir=data_dir)
    upgrade(settings.resolved_database_url)
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "armed").touch()
    env = clean_env(data_dir, SS_FAULT_DIR=str(faults))
    app = create_app(settings)
    with SessionStore.from_settings(settings) as store:
        sid = store.create_session(tenant_id="acme").id
        handle = enqueue_append(sid, [{"type": "note", "n": 1}], idempotency_key="k", app=app)
        first = WorkerProcess(env, tmp_path / "w1.log", concurrency=1, include="tests.faults")
        try:
            wait_for((faults / "committed").exists, 60, "the write to commit and hang")
        finally:
            first.kill()
        assert store.get_session(sid).head_seq == 1
        assert len(list((data_dir / "queue" / "claimed").iterdir())) == 1  # held, not lost
        second = WorkerProcess(env, tmp_path / "w2.log", concurrency=1)
        try:
            result = handle.get(timeout=60)
        finally:
            second.stop()
        assert result.replayed and (result.first_seq, result.last_seq) == (1, 1)
        assert store.get_session(sid).head_seq == 1


@pytest.mark.slow
def test_a_write_that_kills_its_worker_each_time_is_given_up_on_the_embedded_broker(
    tmp_path: Path,
) -> None:
    """The pool process running it killed every time (as by the OOM killer): the message
    came back after each kill and ran again, for ever (the embedded broker counted no
    delivery), where Redis gives it up. Counted in the message now: the second delivery is
    the last, the write is dead-lettered as DeliveriesExhausted, and the queue goes on."""
    from core.errors import WriteRejected

    data_dir = tmp_path / "data"
    settings = Settings(data_dir=data_dir)
    upgrade(settings.resolved_database_url)
    runs = tmp_path / "runs"
    env = clean_env(data_dir, SS_KILL_ON_POISON=str(runs), SESSIONSTORE_TASK_MAX_DELIVERIES="2")
    app = create_app(settings)
    with SessionStore.from_settings(settings) as store:
        sid = store.create_session(tenant_id="acme").id
        worker = WorkerProcess(env, tmp_path / "w.log", concurrency=1, include="tests.faults")
        try:
            poison = enqueue_append(sid, [{"type": "note", "poison": True}], app=app)
            with pytest.raises(WriteRejected) as given_up:
                poison.get(timeout=120)
            after = enqueue_append(sid, [{"type": "note", "n": 1}], app=app).get(timeout=60)
        finally:
            worker.stop()
    assert given_up.value.error_type == "DeliveriesExhausted"
    assert len(runs.read_text().split()) == 2  # killed twice, then not run again
    assert (after.first_seq, after.last_seq) == (1, 1)


def test_a_delivered_message_body_is_decoded_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claimed message is built at the claim to check it, then again by kombu on
    delivery: its body was decoded (base64) twice. The same bodies come out."""
    from kombu.transport import virtual

    decoded: list[object] = []
    real = virtual.Channel.decode_body

    def counting(self: Any, body: Any, encoding: Any = None) -> Any:
        decoded.append(body)
        return real(self, body, encoding)

    monkeypatch.setattr(virtual.Channel, "decode_body", counting)
    with broker_connection(Settings(data_dir=tmp_path)) as conn:
        queue = conn.SimpleQueue("once")
        for i in range(3):
            queue.put({"i": i, "pad": "z" * 1000})
        got = []
        for _ in range(3):
            message = queue.get(timeout=5)
            got.append(message.payload["i"])
            message.ack()
    assert sorted(got) == [0, 1, 2]
    assert len(decoded) == len(set(decoded)) == 3


def test_a_retry_counts_its_deliveries_from_one_on_the_embedded_broker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry is a new message (Redis counts it under its retry number): Celery copies a
    request's unknown headers into it, so on this broker a write delivered twice, then
    retried after a storage blip, began its retry at the second delivery, and was given up
    that much sooner. Its retry counts from one."""
    from core.errors import StorageUnavailable
    from tasks import writes

    data_dir = tmp_path / "data"
    settings = Settings(data_dir=data_dir)
    upgrade(settings.resolved_database_url)
    app = create_app(settings)
    seen: list[int] = []
    real_count, real_validate = writes.delivery_count, writes.validate_write

    def counted(task: Any) -> int:
        seen.append(real_count(task))
        return seen[-1]

    def blip_once(*args: Any) -> Any:
        if len(seen) == 1:
            raise StorageUnavailable("database", "a blip")
        return real_validate(*args)

    monkeypatch.setattr(writes, "delivery_count", counted)
    monkeypatch.setattr(writes, "validate_write", blip_once)
    monkeypatch.setattr(writes, "backoff_seconds", lambda *a: 0.0)
    with SessionStore.from_settings(settings) as store:
        sid = store.create_session(tenant_id="acme").id
        handle = enqueue_append(sid, [{"type": "note"}], app=app)
        (queued,) = (data_dir / "queue" / "in").glob("*.msg")
        message = json.loads(queued.read_text())
        message["headers"][broker.DELIVERIES] = 2  # delivered once before, restored
        queued.write_text(json.dumps(message))
        with thread_worker(app, concurrency=1):
            result = handle.get(timeout=60)
    assert (result.first_seq, seen) == (1, [2, 1])
