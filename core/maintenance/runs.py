"""The run log of periodic maintenance jobs (``maintenance_runs``), and the progress
callback long maintenance work reports through."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, insert, select

from core.db import read_connection, write_transaction
from core.models import MaintenanceRunRow, table_of

_runs = table_of(MaintenanceRunRow)

# The periodic jobs whose executions are logged (their tasks: sessionstore.<job>)
GC_JOB = "gc_blobs"
EXPIRE_JOB = "expire_artifacts"
RECONCILE_JOB = "reconcile_forks"
JOBS = (GC_JOB, EXPIRE_JOB, RECONCILE_JOB)

# (phase, done so far, total or None when unknown); phases: blobs, files, artifacts
Progress = Callable[[str, int, int | None], None]


@dataclass(frozen=True, slots=True)
class MaintenanceRun:
    id: int
    job: str
    started_at: datetime
    finished_at: datetime
    ran: bool
    report: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "job": self.job,
            "started_at": self.started_at.isoformat(),
            "finished_at": self.finished_at.isoformat(),
            "ran": self.ran,
            "report": self.report,
        }


class MaintenanceRuns:
    """The ``maintenance_runs`` table: one row per execution of a periodic job."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def record(
        self,
        *,
        job: str,
        started_at: datetime,
        finished_at: datetime,
        ran: bool,
        report: dict[str, Any],
    ) -> None:
        values = {
            "job": job,
            "started_at": started_at,
            "finished_at": finished_at,
            "ran": ran,
            "report": report,
        }
        with write_transaction(self.engine) as conn:
            conn.execute(insert(_runs).values(values))

    def recent(self, *, job: str | None = None, limit: int = 100) -> list[MaintenanceRun]:
        """The latest runs first."""
        query = select(_runs).order_by(_runs.c.started_at.desc(), _runs.c.id.desc())
        if job is not None:
            query = query.where(_runs.c.job == job)
        with read_connection(self.engine) as conn:
            rows = conn.execute(query.limit(max(1, limit))).all()
        return [
            MaintenanceRun(r.id, r.job, r.started_at, r.finished_at, bool(r.ran), dict(r.report))
            for r in rows
        ]
