"""Sending the follow-up tasks the library asks for (a fork's artifact copy), by name.

Kept apart from the task modules so ``tasks.runtime`` can wire it into the store without
importing them (no cycle between runtime, forks and writes).
"""

from __future__ import annotations

from celery import Celery
from celery.result import AsyncResult

from tasks.app import QUEUE, get_app

COPY_TASK = "sessionstore.copy_artifacts"


def enqueue_copy_artifacts(
    fork_id: str, app: Celery | None = None, *, expires: float | None = None
) -> AsyncResult:
    """Enqueue the artifact copy of a fork (by task name: any Celery client can)."""
    app = app or get_app()
    return app.send_task(COPY_TASK, kwargs={"fork_id": fork_id}, queue=QUEUE, expires=expires)
