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
from core.maintenance.runs import RECONCILE_JOB
from core.store import SessionStore
from tasks.app import sessionstore_task, settings_of
from tasks.enqueue import COPY_TASK, enqueue_copy_artifacts
from tasks.maintenance import run_periodic
from tasks.retry import backoff_seconds, is_transient
from tasks.runtime import store_for

logger = logging.getLogger(__name__)

RECONCILE_TASK = f"sessionstore.{RECONCILE_JOB}"
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
    """Repair half-done moves and re-enqueue fork copies still pending: run once per
    period and recorded in ``maintenance_runs`` like GC and expiry (``run_periodic``)."""
    settings = settings_of(self.app)
    timeout = settings.fork_copy_timeout_seconds

    def work(store: SessionStore) -> dict[str, Any]:
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
        return {"requeued": len(fork_ids), "fork_ids": fork_ids, "moves_repaired": repaired}

    return run_periodic(self, RECONCILE_JOB, settings.reconcile_schedule, work)
