"""How many times a queued message was delivered, for the one that never finishes.

A task acked late and killed at the hard time limit (stuck in C, where the soft limit
cannot reach it), or whose worker is lost each time, goes back to the queue (so it is
not lost) and runs again after the visibility timeout: for ever, one pool process per
hard limit, if it is stuck every time. Redis marks a message it restores as redelivered;
only then is the delivery counted, in Redis, under the message's task id and retry (a
retry is a new message). A first delivery costs nothing.
"""

from __future__ import annotations

import logging

from celery import Task
from celery.exceptions import SoftTimeLimitExceeded

from core.broker import DELIVERIES, delivery_number
from tasks.app import settings_of

logger = logging.getLogger(__name__)

PREFIX = "sessionstore:deliveries"


def delivery_count(task: Task) -> int:
    """This delivery's number: 1 for a first delivery (or where nothing counts them: an
    AMQP broker), else how many times it was delivered (Redis: counted in Redis; the
    embedded broker: in the message)."""
    info = task.request.delivery_info or {}
    settings = settings_of(task.app)
    broker = settings.broker_url or ""
    if not broker:  # the embedded broker counts them in the message (core.broker)
        return delivery_number(getattr(task.request, DELIVERIES, None))
    if not info.get("redelivered") or not broker.startswith(("redis://", "rediss://")):
        return 1
    key = _key(task)
    # kept for as long as the redeliveries it counts can take, and then some
    ttl = settings.task_visibility_timeout * (settings.task_max_deliveries + 2)
    try:
        with task.app.connection_for_write() as connection:
            client = connection.default_channel.client  # redis-py, on the broker's URL
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
        with task.app.connection_for_write() as connection:
            connection.default_channel.client.delete(_key(task))
    except Exception as exc:  # it expires on its own
        logger.warning("could not drop a delivery count", extra={"error": repr(exc)})


def _key(task: Task) -> str:
    return f"{PREFIX}:{task.request.id}:{task.request.retries}"
