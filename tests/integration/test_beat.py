"""The maintenance beat: schedule from settings, one run per period, real worker and beats.

The worker is a real Celery worker (threads pool) on real Redis and PostgreSQL; the beat
test runs two ``celery beat`` processes at once and counts executions in
``maintenance_runs``.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.schedules import crontab, schedule
from sqlalchemy import update

from core import SessionStore, Settings
from core.maintenance.runs import MaintenanceRun
from core.models import BlobRow, utcnow
from tasks.app import beat_schedule, create_app
from tasks.locks import PREFIX
from tests.support import BeatProcess, settings_env, thread_worker, wait_for

BEAT_SECONDS = float(os.environ.get("SESSIONSTORE_BEAT_TEST_SECONDS", "14"))
PERIOD_S = 2
_JOBS = ("gc_blobs", "expire_artifacts")
_blobs = BlobRow.__table__  # type: ignore[attr-defined]


def test_the_schedule_comes_from_settings() -> None:
    settings = Settings(gc_schedule="0 3 * * *", expire_schedule="30", reconcile_schedule="45")
    jobs = beat_schedule(settings)
    assert {j["task"] for j in jobs.values()} == {
        "sessionstore.gc_blobs",
        "sessionstore.expire_artifacts",
        "sessionstore.reconcile_forks",
    }
    gc = jobs["gc-blobs"]
    assert isinstance(gc["schedule"], crontab) and gc["schedule"].hour == {3}
    expire = jobs["expire-artifacts"]
    assert isinstance(expire["schedule"], schedule) and expire["schedule"].seconds == 30
    # Interval jobs expire after one period: a backlog never piles up.
    assert expire["options"]["expires"] == 30.0 and jobs["reconcile-forks"]["options"]["expires"]


def test_the_maintenance_tasks_are_registered() -> None:
    app = create_app(Settings())
    app.loader.import_default_modules()
    assert {"sessionstore.gc_blobs", "sessionstore.expire_artifacts"} <= set(app.tasks)


# a real worker ----------------------------------------------------------------------------


@pytest.fixture
def beat_settings(queue_settings: Settings) -> Settings:
    return queue_settings.with_overrides(gc_grace_seconds=600)


@pytest.fixture
def bstore(beat_settings: Settings) -> Iterator[SessionStore]:
    with SessionStore.from_settings(beat_settings) as s:
        yield s


@pytest.fixture
def app(beat_settings: Settings) -> Celery:
    return create_app(beat_settings)


@pytest.fixture
def worker(app: Celery) -> Iterator[None]:
    with thread_worker(app, concurrency=2):
        yield


def _send(app: Celery, name: str, **kwargs: Any) -> dict[str, Any]:
    result: dict[str, Any] = app.send_task(name, kwargs=kwargs, queue="sessionstore").get(
        timeout=60
    )
    return result


@pytest.mark.postgres
@pytest.mark.redis
def test_a_second_run_in_the_same_period_is_skipped(
    app: Celery, bstore: SessionStore, worker: None
) -> None:
    blob_hash = bstore.blobs.put(b"garbage " * 100).hash
    with bstore.engine.begin() as conn:
        old = utcnow() - timedelta(hours=1)
        conn.execute(update(_blobs).where(_blobs.c.hash == blob_hash).values(last_written_at=old))

    first = _send(app, "sessionstore.gc_blobs")
    assert first["ran"] and first["report"]["deleted"] == 1 and first["report"]["applied"]
    gc_runs = [("gc_blobs", True)]
    second = _send(app, "sessionstore.gc_blobs")
    if second["slot"] != first["slot"]:
        # The period ended between the two sends: that was the next period's run, and ran;
        # one more is in its period.
        assert second["ran"]
        gc_runs.append(("gc_blobs", True))
        first, second = second, _send(app, "sessionstore.gc_blobs")
    assert second["slot"] == first["slot"]
    assert not second["ran"] and second["report"] is None
    expired = _send(app, "sessionstore.expire_artifacts")

    assert expired["ran"] and expired["report"]["deleted"] == 0
    assert not bstore.blobs.index.registered(blob_hash)
    runs = bstore.maintenance_runs.recent()
    assert [(r.job, r.ran) for r in reversed(runs)] == [
        *gc_runs,
        ("gc_blobs", False),
        ("expire_artifacts", True),
    ]
    assert runs[-1].report["report"]["deleted"] == 1  # the oldest: the first run


@pytest.mark.postgres
@pytest.mark.redis
def test_an_overlapping_run_is_skipped(
    app: Celery, bstore: SessionStore, worker: None, redis_url: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    running = client.lock(f"{PREFIX}:gc_blobs:running", timeout=60, thread_local=False)
    assert running.acquire(blocking=False)  # another run of the job is still going
    try:
        assert not _send(app, "sessionstore.gc_blobs")["ran"]
    finally:
        running.release()
        client.close()
    assert _send(app, "sessionstore.gc_blobs")["ran"]  # the next period's run goes ahead


# two beat processes -----------------------------------------------------------------------


def _runs_by_job(runs: list[MaintenanceRun]) -> dict[str, list[MaintenanceRun]]:
    grouped: dict[str, list[MaintenanceRun]] = {}
    for run in runs:
        grouped.setdefault(run.job, []).append(run)
    return grouped


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.redis
def test_two_beat_processes_run_each_job_once_per_period(
    beat_settings: Settings, bstore: SessionStore, tmp_path: Path
) -> None:
    schedules = {"gc_schedule": str(PERIOD_S), "expire_schedule": str(PERIOD_S)}
    settings = beat_settings.with_overrides(**schedules, reconcile_schedule="3600")
    env = settings_env(
        database_url=settings.resolved_database_url,
        broker_url=str(settings.broker_url),
        data_dir=settings.data_dir,
    )
    env |= {
        "SESSIONSTORE_GC_SCHEDULE": str(PERIOD_S),
        "SESSIONSTORE_EXPIRE_SCHEDULE": str(PERIOD_S),
        "SESSIONSTORE_RECONCILE_SCHEDULE": "3600",
    }
    app = create_app(settings)
    with thread_worker(app, concurrency=2):
        beats = [BeatProcess(env, tmp_path / f"beat{i}") for i in range(2)]
        try:
            wait_for(lambda: all(b.sent("sessionstore.gc_blobs") for b in beats), 60, "both beats")
            time.sleep(BEAT_SECONDS)
        finally:
            for beat in beats:
                beat.stop()
        time.sleep(PERIOD_S)  # let the worker finish what the beats sent last

    sent = {job: sum(b.sent(f"sessionstore.{job}") for b in beats) for job in _JOBS}
    by_job = _runs_by_job(bstore.maintenance_runs.recent(limit=10_000))
    for job in _JOBS:
        ran = [r for r in by_job[job] if r.ran]
        per_slot = Counter(r.report["slot"] for r in ran)
        slots = [r.report["slot"] for r in by_job[job]]
        periods = max(slots) - min(slots) + 1
        assert max(per_slot.values()) == 1, f"{job} ran twice in one period: {per_slot}"
        # Two beats sent about twice per period; one run per period went ahead.
        assert len(by_job[job]) >= sent[job] - 2
        assert len(ran) <= periods and len(ran) >= BEAT_SECONDS / PERIOD_S - 2
        assert len(by_job[job]) - len(ran) >= BEAT_SECONDS / PERIOD_S / 2
        assert all(r.report["report"]["applied"] for r in ran)


def test_the_gc_job_resumes_from_the_last_applied_run_that_was_cut_short(
    tmp_path: Path,
) -> None:
    """What ``sessionstore.gc_blobs`` passes on as ``resume``: the run log's latest applied
    run's stopping point; skipped executions and dry runs are looked past, and a complete
    run, or a report that is not one, starts over."""
    from core.maintenance import GcResume
    from tasks.maintenance import GC_JOB, _resume_point

    with SessionStore.from_settings(Settings(data_dir=tmp_path / "data")) as store:

        def record(ran: bool, report: dict[str, Any] | None) -> None:
            result = {"job": GC_JOB, "ran": ran, "report": report}
            now = utcnow()
            store.maintenance_runs.record(
                job=GC_JOB, started_at=now, finished_at=now, ran=ran, report=result
            )

        assert _resume_point(store) is None
        stopped = "a" * 64
        record(True, {"applied": True, "resume": {"phase": "blobs", "after": stopped}})
        assert _resume_point(store) == GcResume("blobs", stopped)
        record(False, None)  # another beat's execution in the same period: skipped
        record(True, {"applied": False, "resume": {"phase": "files", "after": ""}})  # dry
        assert _resume_point(store) == GcResume("blobs", stopped)
        record(True, {"applied": True, "resume": {"phase": "files", "after": ""}})
        assert _resume_point(store) == GcResume("files")
        record(True, {"applied": True, "resume": None})  # complete: start over
        assert _resume_point(store) is None
        record(True, {"applied": True, "resume": {"phase": "blobs", "after": "../etc"}})
        assert _resume_point(store) is None
