"""The queue on RabbitMQ (``amqp://``), which the README offers beside Redis: real prefork
workers, a real RabbitMQ (a virtual host of this module's own), Redis keeping the results
and PostgreSQL the journal (invariants 5, 8 and 10)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from core import SessionStore, Settings
from core.errors import IdempotencyKeyReused, InvalidEvent, WriteRejected
from tasks import enqueue_append
from tasks.app import create_app
from tests.support import queue_worker

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.rabbitmq]


@pytest.fixture
def settings(pg_url: str, redis_url: str, amqp_url: str, tmp_path: Path) -> Settings:
    return Settings(
        data_dir=tmp_path / "data",
        database_url=pg_url,
        broker_url=amqp_url,
        result_backend=redis_url,
        task_max_deliveries=2,
    )


@pytest.fixture
def app(settings: Settings) -> Celery:
    app = create_app(settings)
    app.control.purge()  # what an earlier test of the module left in the virtual host
    return app


def _worker(settings: Settings, tmp_path: Path, include: str | None = None, **env: str) -> Any:
    return queue_worker(
        settings,
        tmp_path,
        include=include,
        SESSIONSTORE_RESULT_BACKEND=str(settings.result_backend),
        SESSIONSTORE_TASK_MAX_DELIVERIES=str(settings.task_max_deliveries),
        **env,
    )


def note(n: int) -> dict[str, Any]:
    return {"type": "note", "n": n}


def test_writes_land_once_gapless_and_bad_ones_are_refused_typed(
    app: Celery, store: SessionStore, settings: Settings, tmp_path: Path
) -> None:
    sids = [store.create_session(tenant_id="acme").id for _ in range(2)]
    with _worker(settings, tmp_path):
        handles = [
            enqueue_append(sids[i % 2], [note(i)], idempotency_key=f"k{i}", app=app)
            for i in range(12)
        ]
        results = [h.get(timeout=60) for h in handles]
        again = enqueue_append(sids[0], [note(0)], idempotency_key="k0", app=app).get(timeout=60)
        with pytest.raises(InvalidEvent):  # refused before anything is published
            enqueue_append(sids[1], [note(99), {"type": 7}], app=app)
        with pytest.raises(IdempotencyKeyReused):  # k1 holds other content: at enqueue or after
            enqueue_append(sids[1], [note(99)], idempotency_key="k1", app=app).get(timeout=60)
    assert not any(r.replayed for r in results)
    assert again == results[0]  # the key answers with its outcome; nothing written again
    for i, sid in enumerate(sids):
        # each once (writes enqueued at once to one session land in any order, gapless)
        assert sorted(e.payload["n"] for e in store.read(sid)) == list(range(i, 12, 2))
        assert [e.seq for e in store.read(sid)] == list(range(1, 7))


@pytest.mark.slow
def test_a_write_that_kills_its_worker_each_time_is_given_up_on_rabbitmq(
    app: Celery, store: SessionStore, settings: Settings, tmp_path: Path
) -> None:
    """The pool process running it killed every time (as by the OOM killer): RabbitMQ
    gives the message back, marked redelivered, after each kill, and it ran again for ever
    (nothing counted deliveries on AMQP). Counted in the result backend's Redis now: the
    second delivery is the last, the write is dead-lettered as DeliveriesExhausted, and the
    queue goes on."""
    sid = store.create_session(tenant_id="acme").id
    runs = tmp_path / "runs"
    with _worker(settings, tmp_path, "tests.faults", SS_KILL_ON_POISON=str(runs)) as log:
        poison = enqueue_append(sid, [{"type": "note", "poison": True}], app=app)
        with pytest.raises(WriteRejected) as given_up:
            poison.get(timeout=120)
        after = enqueue_append(sid, [note(1)], app=app).get(timeout=60)
    assert given_up.value.error_type == "DeliveriesExhausted", log.read_text()[-3000:]
    assert len(runs.read_text().split()) == 2  # killed twice, then not run again
    assert (after.first_seq, after.last_seq) == (1, 1)
