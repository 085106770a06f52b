"""``sessionstore.rehydrate``: a session's full content, built by a worker for whoever asks.

The work is ``core.interop.rehydrated`` (streamed, deduplicated, an expiring artifact); this
module owns the task, its retries, its progress reports and the producer's handle. The task
returns a small JSON document, never the content: the content is the artifact it names.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from celery import Celery, Task, states
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from core.errors import (
    DeliveriesExhausted,
    InvalidEvent,
    RehydrateInProgress,
    RehydrateTooLong,
    SessionNotFound,
    SessionStoreError,
    StorageUnavailable,
)
from core.interop.rehydrated import Request, rehydrate
from core.translate import storage_errors, translate
from tasks.app import QUEUE, get_app, sessionstore_task, settings_of
from tasks.deliveries import delivery_count
from tasks.results import QueueTimeout
from tasks.retry import backoff_seconds, retry_or_requeue
from tasks.runtime import store_for

log = logging.getLogger(__name__)

REHYDRATE_TASK = "sessionstore.rehydrate"


@sessionstore_task(name=REHYDRATE_TASK, bind=True, max_retries=None)
def rehydrate_task(
    self: Task, session_id: str, tenant_id: str, at_seq: int | None = None, format: str = "pi"
) -> dict[str, Any]:
    def progress(done: int, total: int) -> None:
        try:
            self.update_state(state="PROGRESS", meta={"done": done, "total": total})
        except Exception as exc:  # only a report: the result backend away ends no build
            log.warning("could not report rehydrate progress", extra={"error": repr(exc)})

    try:
        deliveries = delivery_count(self)
    except SoftTimeLimitExceeded:  # escaping, it would end the task acked as failed
        retry_or_requeue(self, 1.0)
    if deliveries > settings_of(self.app).task_max_deliveries:  # stuck each time: give up
        return {"status": "refused", **DeliveriesExhausted(deliveries).to_dict()}
    request = Request(session_id=session_id, tenant_id=tenant_id, format=format, at_seq=at_seq)
    # Wait for another worker's identical build within this task's time limit, not beyond.
    soft_limit = float(self.app.conf.task_soft_time_limit or 60)
    store = store_for(self.app)
    try:
        result = rehydrate(store, request, progress=progress, wait_s=max(1.0, soft_limit / 2))
    except (SessionNotFound, InvalidEvent) as exc:
        return {"status": "refused", **exc.to_dict()}
    except SoftTimeLimitExceeded:  # built again, it would be cut short again
        return {"status": "refused", **RehydrateTooLong(soft_limit).to_dict()}
    except RehydrateInProgress:
        retry_or_requeue(self, 1.0)
    except Exception as exc:
        away = translate(exc)
        if not isinstance(away, StorageUnavailable):
            raise
        settings = settings_of(self.app)
        if self.request.retries < settings.task_max_retries:
            retry_or_requeue(
                self, backoff_seconds(self.request.retries, settings.task_visibility_timeout)
            )
        # out of retries: the caller gets the type to act on (a result, not a FAILURE,
        # whose exception Celery rebuilds from its message alone)
        return {"status": "unavailable", **away.to_dict()}
    return {"status": "ok", **result}


class RehydrateHandle:
    """What ``enqueue_rehydrate`` returns: poll ``progress()``, wait with ``get()``."""

    def __init__(self, app: Celery, task_id: str) -> None:
        self.app = app
        self.id = task_id

    def _meta(self) -> dict[str, Any]:
        with storage_errors("broker"):
            meta: dict[str, Any] = self.app.backend.get_task_meta(self.id)
        return meta

    def progress(self) -> tuple[int, int] | None:
        meta = self._meta()
        if meta["status"] == "PROGRESS" and isinstance(meta.get("result"), dict):
            return int(meta["result"]["done"]), int(meta["result"]["total"])
        return None

    def get(self, timeout: float | None = 60.0) -> dict[str, Any]:
        """The result: ``ref`` (an ``art_…`` id ``resolve`` and ``sessionstore read``
        accept), ``size``, ``sha256``, ``entries``, ``head_seq``, ``missing_blobs``,
        ``expires_at``. A refused request raises its typed error (e.g. SessionNotFound)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.01
        while True:
            meta = self._meta()
            if meta["status"] == states.SUCCESS:
                return _outcome(meta["result"])
            if meta["status"] in states.PROPAGATE_STATES:
                exc = self.app.backend.exception_to_python(meta["result"])
                # A run killed at the hard time limit is recorded as a FAILURE, and its
                # message goes back to the queue (task_acks_on_timeout off): not an outcome.
                if not isinstance(exc, TimeLimitExceeded):
                    raise SessionStoreError(f"rehydrate {self.id} failed: {exc!r}")
            if deadline is not None and time.monotonic() >= deadline:
                raise QueueTimeout(f"rehydrate {self.id} not finished after {timeout}s")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.2)


def _outcome(result: dict[str, Any]) -> dict[str, Any]:
    if result.get("status") == "refused":
        if result.get("error") == "SessionNotFound":
            raise SessionNotFound(str(result.get("session_id", "")), str(result.get("message")))
        if result.get("error") == "DeliveriesExhausted":
            raise DeliveriesExhausted(int(result.get("deliveries", 0)))
        if result.get("error") == "RehydrateTooLong":
            raise RehydrateTooLong(float(result.get("limit_s", 0)))
        raise InvalidEvent(str(result.get("field", "")), str(result.get("reason")))
    if result.get("status") == "unavailable":
        raise StorageUnavailable(str(result.get("component")), str(result.get("message")))
    return result


def enqueue_rehydrate(
    session_id: str,
    *,
    tenant_id: str,
    at_seq: int | None = None,
    format: str = "pi",
    app: Celery | None = None,
) -> RehydrateHandle:
    """Ask the workers for a session's rehydrated content (``pi`` or ``events`` JSONL).
    Bad arguments are refused here (InvalidEvent naming the field), before anything is
    published; a broker that cannot be reached is ``StorageUnavailable``."""
    Request(session_id=session_id, tenant_id=tenant_id, format=format, at_seq=at_seq).check()
    app = app or get_app()
    task_id = str(uuid.uuid4())
    kwargs = {"session_id": session_id, "tenant_id": tenant_id, "at_seq": at_seq, "format": format}
    with storage_errors("broker"):
        app.send_task(REHYDRATE_TASK, kwargs=kwargs, task_id=task_id, queue=QUEUE)
    return RehydrateHandle(app, task_id)
