"""When a task retries, and how long it waits: decided from the typed errors alone."""

from __future__ import annotations

import random
import time
from typing import NoReturn

from celery import Task
from celery.exceptions import Reject

from core.broker import DELIVERY_HEADERS
from core.errors import StorageUnavailable
from core.translate import translate

BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 60.0


def is_transient(exc: BaseException) -> bool:
    """A failure worth retrying: storage (database, broker, blobs) unreachable or busy.

    Errors reach tasks typed by ``core``'s storage boundary; ``translate`` is applied
    once more for the few raised outside it (the broker, a connection refused early).
    """
    return isinstance(translate(exc), StorageUnavailable)


def backoff_seconds(retries: int, visibility_timeout: int) -> float:
    """Exponential backoff with full jitter, capped well below the visibility timeout.

    A retried task waits in the worker unacked until its ETA; an ETA past the visibility
    timeout would let Redis deliver the message a second time.
    """
    cap = min(BACKOFF_CAP_S, visibility_timeout / 4)
    # The exponent is bounded: 2.0**1024 overflows a float, and a retry that raised there
    # (after ~8 h of an outage at the cap) ended its write as a failure, acked.
    return random.uniform(0, min(cap, BACKOFF_BASE_S * 2.0 ** min(retries, 32)))


def retry_or_requeue(task: Task, countdown: float, **options: object) -> NoReturn:
    """``task.retry(countdown=...)``. If the retry cannot be published (the broker away),
    Celery rejects the message without requeueing it, and the task is lost: requeue it.

    The retry is a new message, its deliveries counted from one, as on Redis (whose count
    is keyed by the retry): Celery copies a request's unknown headers into it, and on the
    embedded broker those carried the count of the message it replaces."""
    copied = task.request.as_execution_options().get("headers") or {}
    headers = {k: v for k, v in copied.items() if k not in DELIVERY_HEADERS}
    try:
        task.retry(countdown=countdown, headers=headers, **options)
    except Reject:
        time.sleep(min(countdown, 5.0))
        raise Reject("retry could not be published", requeue=True) from None
    raise AssertionError("unreachable: Task.retry always raises")
