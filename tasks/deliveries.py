"""How many times a queued message was delivered, for the one that never finishes.

A task acked late and killed at the hard time limit (stuck in C, where the soft limit
cannot reach it), or whose worker is lost each time, goes back to the queue (so it is
not lost) and runs again after the visibility timeout: for ever, one pool process per
hard limit, if it is stuck every time. Redis marks a message it restores as redelivered,
and RabbitMQ one it gives back; only then is the delivery counted, in Redis (the broker's,
or on RabbitMQ the result backend's: AMQP's classic queues count nothing), under the
message's task id and retry (a retry is a new message). A first delivery costs nothing.
The embedded broker counts them in the message itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Task
from celery.exceptions import SoftTimeLimitExceeded

from core.broker import DELIVERIES, delivery_number
from tasks.app import REDIS_URLS, settings_of

logger = logging.getLogger(__name__)

PREFIX = "sessionstore:deliveries"


def delivery_count(task: Task) -> int:
    """This delivery's number: 1 for a first delivery (or where nothing counts them:
    RabbitMQ without a Redis result backend), else how many times it was delivered (counted
    in Redis; the embedded broker: in the message)."""
    info = task.request.delivery_info or {}
    settings = settings_of(task.app)
    broker = settings.broker_url or ""
    if not broker:  # the embedded broker counts them in the message (core.broker)
        return delivery_number(getattr(task.request, DELIVERIES, None))
    if not info.get("redelivered"):
        return 1
    key = _key(task)
    # kept for as long as the redeliveries it counts can take, and then some
    ttl = settings.task_visibility_timeout * (settings.task_max_deliveries + 2)
    try:
        with _counter(task) as client:
            if client is None:
                return 1
            pipe = client.pipeline()
            pipe.incr(key)
            pipe.expire(key, ttl)
            redeliveries, _ = pipe.execute()
    except SoftTimeLimitExceeded:
        raise  # the write's limit, not a count that failed: never taken for a first delivery
    except Exception as exc:  # not counted: the write runs, as it would without a count
        logger.warning("could not count a redelivery", extra={"error": repr(exc)})
        return 1
    return 1 + int(redeliveries)


def forget_deliveries(task: Task) -> None:
    """Drop the count once the message has an outcome: a later send under the same (session,
    key), after the cause is fixed, starts from one (called only after a count was made)."""
    if not settings_of(task.app).broker_url:
        return  # the embedded broker's count is in the message, which is done with
    try:
        with _counter(task) as client:
            if client is not None:
                client.delete(_key(task))
    except Exception as exc:  # it expires on its own
        logger.warning("could not drop a delivery count", extra={"error": repr(exc)})


@contextmanager
def _counter(task: Task) -> Iterator[Any]:
    """The redis-py client deliveries are counted in: the broker's when it is Redis, else
    the result backend's when that is (RabbitMQ beside Redis); None where there is no Redis
    (RabbitMQ with the rpc:// backend: counted by nothing, as before; see the README)."""
    settings = settings_of(task.app)
    if (settings.broker_url or "").startswith(REDIS_URLS):
        with task.app.connection_for_write() as connection:
            yield connection.default_channel.client  # redis-py, on the broker's URL
    elif (settings.result_backend or "").startswith(REDIS_URLS):
        yield task.app.backend.client  # the backend's own pool: nothing to close here
    else:
        yield None


def _key(task: Task) -> str:
    return f"{PREFIX}:{task.request.id}:{task.request.retries}"
