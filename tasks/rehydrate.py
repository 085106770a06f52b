"""``sessionstore.rehydrate``: a session's full content, built by a worker for whoever asks.

The work is ``core.interop.rehydrated`` (streamed, deduplicated, an expiring artifact); this
module owns the task, its retries, its progress reports and the producer's handle. The task
returns a small JSON document, never the content: the content is the artifact it names.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from celery import Celery, Task, states
from celery.exceptions import SoftTimeLimitExceeded

from core.errors import (
    DeliveriesExhausted,
    InvalidEvent,
    RehydrateInProgress,
    SessionNotFound,
    SessionStoreError,
)
from core.interop.rehydrated import FORMATS, Request, rehydrate
from tasks.app import QUEUE, get_app, sessionstore_task, settings_of
from tasks.deliveries import delivery_count
from tasks.results import QueueTimeout
from tasks.retry import backoff_seconds, is_transient
from tasks.runtime import store_for

REHYDRATE_TASK = "sessionstore.rehydrate"


@sessionstore_task(name=REHYDRATE_TASK, bind=True, max_retries=None)
def rehydrate_task(
    self: Task, session_id: str, tenant_id: str, at_seq: int | None = None, format: str = "pi"
) -> dict[str, Any]:
    def progress(done: int, total: int) -> None:
        self.update_state(state="PROGRESS", meta={"done": done, "total": total})

    try:
        deliveries = delivery_count(self)
    except SoftTimeLimitExceeded:  # escaping, it would end the task acked as failed
        raise self.retry(countdown=1.0) from None
    if deliveries > settings_of(self.app).task_max_deliveries:  # stuck each time: give up
        return {"status": "refused", **DeliveriesExhausted(deliveries).to_dict()}
    request = Request(session_id=session_id, tenant_id=tenant_id, format=format, at_seq=at_seq)
    # Wait for another worker's identical build within this task's time limit, not beyond.
    wait_s = max(1.0, float(self.app.conf.task_soft_time_limit or 60) / 2)
    store = store_for(self.app)
    try:
        return {"status": "ok", **rehydrate(store, request, progress=progress, wait_s=wait_s)}
    except (SessionNotFound, InvalidEvent) as exc:
        return {"status": "refused", **exc.to_dict()}
    except RehydrateInProgress:
        raise self.retry(countdown=1.0) from None
    except Exception as exc:
        settings = settings_of(self.app)
        if is_transient(exc) and self.request.retries < settings.task_max_retries:
            delay = backoff_seconds(self.request.retries, settings.task_visibility_timeout)
            raise self.retry(countdown=delay) from None
        raise


class RehydrateHandle:
    """What ``enqueue_rehydrate`` returns: poll ``progress()``, wait with ``get()``."""

    def __init__(self, app: Celery, task_id: str) -> None:
        self.app = app
        self.id = task_id

    def progress(self) -> tuple[int, int] | None:
        meta = self.app.backend.get_task_meta(self.id)
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
            meta = self.app.backend.get_task_meta(self.id)
            if meta["status"] == states.SUCCESS:
                return _outcome(meta["result"])
            if meta["status"] in states.PROPAGATE_STATES:
                raise SessionStoreError(f"rehydrate {self.id} failed: {meta['result']!r}")
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
        raise InvalidEvent(str(result.get("field", "")), str(result.get("reason")))
    return result


def enqueue_rehydrate(
    session_id: str,
    *,
    tenant_id: str,
    at_seq: int | None = None,
    format: str = "pi",
    app: Celery | None = None,
) -> RehydrateHandle:
    """Ask the workers for a session's rehydrated content (``pi`` or ``events`` JSONL)."""
    if format not in FORMATS:
        raise InvalidEvent("format", f"must be one of {', '.join(FORMATS)}")
    if at_seq is not None and (isinstance(at_seq, bool) or not 0 <= at_seq < 2**63):
        raise InvalidEvent("at_seq", "must be a seq from 0")
    app = app or get_app()
    task_id = str(uuid.uuid4())
    kwargs = {"session_id": session_id, "tenant_id": tenant_id, "at_seq": at_seq, "format": format}
    app.send_task(REHYDRATE_TASK, kwargs=kwargs, task_id=task_id, queue=QUEUE)
    return RehydrateHandle(app, task_id)
