"""``sessionstore.append``: the queue path of a write. Retries and dead-lettering live here;
the write itself is ``SessionStore.append``, the same core code as the library path."""

from __future__ import annotations

import logging
import random
from typing import Any

import redis.exceptions
from celery import Task
from kombu.exceptions import OperationalError as KombuOperationalError

from core.db import is_transient_db_error
from tasks.app import sessionstore_task, settings_of
from tasks.runtime import store_for

logger = logging.getLogger(__name__)

BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 60.0


def is_transient(exc: BaseException) -> bool:
    """A failure worth retrying: the database or Redis was unreachable or busy."""
    if is_transient_db_error(exc):
        return True
    return isinstance(
        exc,
        (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            KombuOperationalError,
            ConnectionError,
            TimeoutError,
        ),
    )


def backoff_seconds(retries: int, visibility_timeout: int) -> float:
    """Exponential backoff with full jitter, capped well below the visibility timeout.

    A retried task waits in the worker unacked until its ETA; an ETA past the visibility
    timeout would let Redis deliver the message a second time.
    """
    cap = min(BACKOFF_CAP_S, visibility_timeout / 4)
    return random.uniform(0, min(cap, BACKOFF_BASE_S * 2**retries))


@sessionstore_task(name="sessionstore.append", bind=True, max_retries=None)
def append(
    self: Task,
    session_id: str,
    events: Any,
    expected_seq: int | None = None,
    idempotency_key: str | None = None,
) -> dict[str, Any]:
    settings = settings_of(self.app)
    key = idempotency_key or str(self.request.id)
    store = store_for(self.app)
    try:
        result = store.append(session_id, events, expected_seq=expected_seq, idempotency_key=key)
    except Exception as exc:
        if is_transient(exc) and self.request.retries < settings.task_max_retries:
            delay = backoff_seconds(self.request.retries, settings.task_visibility_timeout)
            logger.warning(
                "transient failure, retrying write",
                extra={
                    "session_id": session_id,
                    "key": key,
                    "retry_in_s": round(delay, 2),
                    "error": repr(exc),
                },
            )
            raise self.retry(exc=exc, countdown=delay) from exc
        return _dead_letter(
            self, settings.task_visibility_timeout, key, session_id, events, expected_seq, exc
        )
    return {"status": "ok", **result.to_dict()}


def _dead_letter(
    task: Task,
    visibility_timeout: int,
    key: str,
    session_id: str,
    events: Any,
    expected_seq: int | None,
    error: Exception,
) -> dict[str, Any]:
    """Keep a rejected write (bad input, or retries exhausted); never drop it."""
    store = store_for(task.app)
    try:
        letter = store.dead_letters.record(
            idempotency_key=key,
            session_id=session_id,
            events=events,
            expected_seq=expected_seq,
            error=error,
        )
    except Exception as exc:
        if not is_transient(exc):
            raise
        # The database is away: keep the message alive (unbounded retries) until it is back.
        delay = backoff_seconds(task.request.retries, visibility_timeout)
        raise task.retry(exc=exc, countdown=delay, max_retries=None) from exc
    logger.error(
        "write dead-lettered",
        extra={
            "session_id": session_id,
            "key": key,
            "dead_letter_id": letter.id,
            "error_type": letter.error_type,
            "error": letter.error,
        },
    )
    return {
        "status": "dead_lettered",
        "dead_letter_id": letter.id,
        "session_id": session_id,
        "error_type": letter.error_type,
        "error": letter.error,
    }
