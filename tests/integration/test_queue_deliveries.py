"""A message delivered too often is given up, typed, instead of running for ever.

Redis marks a message it restores (a worker killed at the hard time limit, or lost) as
redelivered; ``tasks.deliveries`` counts those deliveries. The slow way to get one is a
kill at the hard limit (``test_queue_limits``); here the message waiting in the queue is
marked as Redis marks it, and a real worker (threads pool, real Redis, real PostgreSQL)
takes it from there, with ``SESSIONSTORE_TASK_MAX_DELIVERIES`` at 1.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
from celery import Celery

from core import SessionStore, Settings
from core.errors import DeliveriesExhausted, IdempotencyKeyReused, WriteRejected
from tasks import enqueue_append
from tasks.app import QUEUE, create_app
from tasks.outcomes import answer_for, stored_outcome, write_digest
from tasks.rehydrate import enqueue_rehydrate
from tests.support import thread_worker

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def note(marker: str) -> dict[str, Any]:
    return {"type": "note", "marker": marker}


@pytest.fixture
def settings(queue_settings: Settings) -> Settings:
    return queue_settings.with_overrides(task_max_deliveries=1)


@pytest.fixture
def app(settings: Settings) -> Celery:
    return create_app(settings)


def mark_redelivered(redis_url: str) -> None:
    """Mark the one message waiting in the queue as kombu's Redis transport marks one it
    restores from the unacked hash (``Channel._do_restore_message``)."""
    client = redis.Redis.from_url(redis_url)
    try:
        (raw,) = client.lrange(QUEUE, 0, -1)
        payload = json.loads(raw)
        payload["headers"]["redelivered"] = True
        payload["properties"]["delivery_info"]["redelivered"] = True
        client.delete(QUEUE)
        client.lpush(QUEUE, json.dumps(payload))
    finally:
        client.close()


def test_a_write_back_too_often_is_dead_lettered_without_running(
    app: Celery, store: SessionStore, redis_url: str
) -> None:
    sid = store.create_session(tenant_id="acme").id
    handle = enqueue_append(sid, [note("stuck")], idempotency_key="k", app=app)
    mark_redelivered(redis_url)
    with thread_worker(app):
        with pytest.raises(WriteRejected) as rejected:
            handle.get(timeout=30)
    assert rejected.value.error_type == "DeliveriesExhausted"
    assert "delivered 2 times" in rejected.value.reason
    assert store.read(sid) == []
    (letter,) = store.dead_letters.list()
    assert letter.events == [note("stuck")]
    assert _counts(redis_url) == []  # forgotten: a send after the fix starts from one


def _counts(redis_url: str) -> list[bytes]:
    client = redis.Redis.from_url(redis_url)
    try:
        return list(client.scan_iter("sessionstore:deliveries:*"))
    finally:
        client.close()


def test_a_write_an_earlier_delivery_committed_is_answered_committed(
    app: Celery, store: SessionStore, redis_url: str
) -> None:
    """Killed after its commit, before its ack: the write landed, and its answer says so."""
    sid = store.create_session(tenant_id="acme").id
    first = store.append(sid, [note("landed")], idempotency_key="k")
    handle = enqueue_append(sid, [note("landed")], idempotency_key="k", app=app)
    mark_redelivered(redis_url)
    with thread_worker(app):
        result = handle.get(timeout=30)
    assert (result.first_seq, result.last_seq) == (first.first_seq, first.last_seq)
    assert store.dead_letters.list() == []
    assert [e.payload["marker"] for e in store.read(sid)] == ["landed"]


def test_other_content_under_a_committed_key_is_dead_lettered_as_such(
    app: Celery, store: SessionStore, redis_url: str
) -> None:
    """Given up, the write is looked up first: other content under a key that committed
    is refused as such, into a dead letter. The key still answers with its commit (whose
    own outcome was never stored: a worker killed in between, or the library): a refusal
    stored first would have stood over it for good."""
    sid = store.create_session(tenant_id="acme").id
    landed = store.append(sid, [note("landed")], idempotency_key="k")
    handle = enqueue_append(sid, [note("other")], idempotency_key="k", app=app)
    mark_redelivered(redis_url)
    with thread_worker(app):
        with pytest.raises(IdempotencyKeyReused):
            handle.get(timeout=30)
    (letter,) = store.dead_letters.list()
    assert letter.error_type == "IdempotencyKeyReused" and letter.events == [note("other")]
    stored = stored_outcome(app, sid, "k")
    answer = answer_for(stored, write_digest([note("landed")]))
    assert answer is not None and answer["status"] == "ok"
    assert answer["last_seq"] == landed.last_seq
    third = answer_for(stored, write_digest([note("a third content")]))  # nobody's "ok"
    assert third is not None and third["status"] == "key_reused"


def test_a_rehydrate_back_too_often_is_refused_typed(
    app: Celery, store: SessionStore, redis_url: str
) -> None:
    sid = store.create_session(tenant_id="acme").id
    store.append(sid, [note("a")])
    handle = enqueue_rehydrate(sid, tenant_id="acme", app=app)
    mark_redelivered(redis_url)
    with thread_worker(app):
        with pytest.raises(DeliveriesExhausted) as refused:
            handle.get(timeout=30)
    assert refused.value.deliveries == 2


def test_a_first_delivery_counts_nothing(app: Celery, store: SessionStore, redis_url: str) -> None:
    """Only a redelivered message costs a count (none is kept for a first delivery)."""
    sid = store.create_session(tenant_id="acme").id
    with thread_worker(app):
        assert enqueue_append(sid, [note("a")], app=app).get(timeout=30).last_seq == 1
    assert _counts(redis_url) == []
