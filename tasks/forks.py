"""``sessionstore.copy_artifacts`` and the ``sessionstore.reconcile_forks`` beat job.

The copy itself is ``SessionStore.copy_fork_artifacts`` (core); it is idempotent, so a
redelivered or re-enqueued task, or two at once, are harmless. The reconciler re-enqueues
copies still pending after ``fork_copy_timeout_seconds``: that covers a crash between the
fork's commit and its enqueue, a lost message, a worker killed mid-copy, and a copy a
storage outage kept pending past the task's retries (the copy raises ``StorageUnavailable``
then, which the task retries like any transient failure).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task

from core.errors import SessionNotFound
from tasks.app import sessionstore_task, settings_of
from tasks.enqueue import COPY_TASK, enqueue_copy_artifacts
from tasks.locks import dedup_window, longest_run_s, periodic_run
from tasks.retry import backoff_seconds, is_transient
from tasks.runtime import store_for

logger = logging.getLogger(__name__)

RECONCILE_TASK = "sessionstore.reconcile_forks"
RECONCILE_BATCH = 1000

__all__ = ["COPY_TASK", "copy_artifacts", "enqueue_copy_artifacts", "reconcile_forks"]


@sessionstore_task(name=COPY_TASK, bind=True, max_retries=None)
def copy_artifacts(self: Task, fork_id: str) -> dict[str, Any]:
    store = store_for(self.app)
    try:
        report = store.copy_fork_artifacts(fork_id)
    except SessionNotFound:
        logger.info("fork gone before its artifact copy ran", extra={"fork_id": fork_id})
        return {"fork_id": fork_id, "status": None}
    except Exception as exc:
        settings = settings_of(self.app)
        if is_transient(exc) and self.request.retries < settings.task_max_retries:
            delay = backoff_seconds(self.request.retries, settings.task_visibility_timeout)
            logger.warning(
                "transient failure, retrying the fork's artifact copy",
                extra={"fork_id": fork_id, "retry_in_s": round(delay, 2), "error": repr(exc)},
            )
            raise self.retry(exc=exc, countdown=delay) from exc
        raise
    return report.to_dict()


@sessionstore_task(name=RECONCILE_TASK, bind=True)
def reconcile_forks(self: Task) -> dict[str, Any]:
    settings = settings_of(self.app)
    window = dedup_window(settings.reconcile_schedule)
    # The lock lasts as long as a run can (it lasted the window, at least 60 s: a longer
    # run had a second one beside it, repairing the same moves)
    with periodic_run(
        self.app, "reconcile_forks", window, max_run_s=longest_run_s(self.app)
    ) as run:
        if not run:
            return {"skipped": True, "requeued": 0}
        timeout = settings.fork_copy_timeout_seconds
        store = store_for(self.app)
        # Moves a crash left half done (invariant 12); the age spares live moves.
        repaired = [r.to_dict() for r in store.repair_moves(older_than_s=timeout)]
        fork_ids = store.pending_forks(older_than_s=timeout, limit=RECONCILE_BATCH)
        for fork_id in fork_ids:
            # Expiring after one timeout keeps a backlog from piling up while no worker
            # runs: the next reconcile sends a fresh one.
            enqueue_copy_artifacts(fork_id, self.app, expires=timeout)
    if fork_ids:
        logger.warning(
            "re-enqueued fork artifact copies still pending",
            extra={"count": len(fork_ids), "older_than_s": timeout, "fork_ids": fork_ids[:20]},
        )
    return {
        "skipped": False,
        "requeued": len(fork_ids),
        "fork_ids": fork_ids,
        "moves_repaired": repaired,
    }
