"""``sessionstore.gc_blobs`` and ``sessionstore.expire_artifacts``: the maintenance beat jobs.

Each run of these, and of ``sessionstore.reconcile_forks`` (``tasks.forks``), is guarded by
``periodic_run``: one run per schedule period, however many beat
processes send the job, and never two at once. Every execution, run or skipped, is recorded
in ``maintenance_runs``. The work itself is ``core.maintenance.gc``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from celery import Task

from core.maintenance import GcResume
from core.maintenance.runs import EXPIRE_JOB, GC_JOB
from core.models import utcnow
from core.store import SessionStore
from tasks.app import sessionstore_task, settings_of
from tasks.locks import dedup_window, hard_limit_s, longest_run_s, period_slot, periodic_run
from tasks.runtime import store_for

logger = logging.getLogger(__name__)

# GC stops between chunks after this share of the soft time limit, so the limit never
# interrupts it between removing a file and committing its row delete.
GC_BUDGET_SHARE = 0.8

Work = Callable[[SessionStore], dict[str, Any]]


@sessionstore_task(name="sessionstore.gc_blobs", bind=True)
def gc_blobs(self: Task, apply: bool = True, grace: float | None = None) -> dict[str, Any]:
    """Blob GC; ``grace`` defaults to ``settings.gc_grace_seconds``. Sent by hand (by name),
    it takes the period's slot like a beat run, so the beat's run in that period skips."""
    budget = _soft_limit_s(self) * GC_BUDGET_SHARE

    def work(store: SessionStore) -> dict[str, Any]:
        resume = _resume_point(store) if apply else None
        report = store.gc_blobs(apply=apply, grace=grace, time_budget_s=budget, resume=resume)
        return report.to_dict()

    return run_periodic(self, GC_JOB, settings_of(self.app).gc_schedule, work)


@sessionstore_task(name="sessionstore.expire_artifacts", bind=True)
def expire_artifacts(self: Task, apply: bool = True) -> dict[str, Any]:
    """Remove oversized-output artifacts past their TTL (files and rows)."""

    def work(store: SessionStore) -> dict[str, Any]:
        return store.expire_artifacts(apply=apply).to_dict()

    return run_periodic(self, EXPIRE_JOB, settings_of(self.app).expire_schedule, work)


def run_periodic(task: Task, job: str, schedule: str, work: Work) -> dict[str, Any]:
    """Run ``work`` if this period's slot is free, and record the execution, run or skipped:
    ``{"job", "ran", "slot", "report"}``, the report being what ``work`` returned."""
    store = store_for(task.app)
    window = dedup_window(schedule)
    started = utcnow()
    now = time.time()
    slot = period_slot(window, now)  # the same slot periodic_run claims
    result: dict[str, Any] = {"job": job, "ran": False, "slot": slot, "report": None}
    max_run_s = longest_run_s(task.app)
    try:
        with periodic_run(task.app, job, window, max_run_s=max_run_s, now=now) as claimed:
            result["ran"] = claimed
            if claimed:
                result["report"] = work(store)
    except Exception as exc:
        result["error"] = repr(exc)
        logger.exception("maintenance job failed", extra={"job": job})
        raise
    finally:
        _record(store, job, started, result)
    logger.info("maintenance job done", extra={"job": job, "ran": result["ran"], "slot": slot})
    return result


def _resume_point(store: SessionStore) -> GcResume | None:
    """Where the last GC run that ran (and applied) stopped, if its budget cut it short: a
    store too big for one run's budget is then swept whole over several, instead of each
    run scanning the same first blobs again and never reaching the rest, or the files."""
    try:
        runs = store.maintenance_runs.recent(job=GC_JOB, limit=20)
    except Exception as exc:  # the log is best effort: start from the beginning
        logger.warning("could not read the GC run log", extra={"error": repr(exc)})
        return None
    for run in runs:
        report = run.report.get("report")
        if run.ran and isinstance(report, dict) and report.get("applied") is True:
            return GcResume.from_report(report)
    return None


def _record(store: SessionStore, job: str, started: datetime, result: dict[str, Any]) -> None:
    """Log the execution; a failure to log must not fail (or retry) the job itself."""
    try:
        store.maintenance_runs.record(
            job=job, started_at=started, finished_at=utcnow(), ran=result["ran"], report=result
        )
    except Exception as exc:  # the log is best effort, whatever the database says
        logger.error("could not record a maintenance run", extra={"job": job, "error": repr(exc)})


def _soft_limit_s(task: Task) -> float:
    return float(task.app.conf.task_soft_time_limit or hard_limit_s(task.app))
