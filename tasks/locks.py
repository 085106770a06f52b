"""One run per period for beat jobs, however many beat processes send them.

Two guards apply to every periodic job:
- the period's *slot* (``floor(now / window)``) is claimed once (SET NX with expiry), so a
  second beat process sending the same job in the same period finds it taken and skips;
- a *running* lock with an owner token is held for the whole run, so a run that outlasts
  its period never overlaps the next one. Only its owner can release it.

With a Redis broker both live in Redis, reached through the app's own broker connection
(no driver imported here); the embedded setup (no Redis) uses a file lock and slot files in
the data dir, which is enough for one machine.
"""

from __future__ import annotations

import fcntl
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from celery import Celery

from core.fsio import replace_atomically
from core.settings import Settings
from tasks.app import settings_of

logger = logging.getLogger(__name__)

PREFIX = "sessionstore:periodic"
CRONTAB_WINDOW_S = 60.0  # a crontab fires at most once a minute


LOCK_MARGIN_S = 60.0
_DEFAULT_LIMIT_S = 900.0


def hard_limit_s(app: Celery) -> float:
    """The tasks' hard time limit: no run outlives it."""
    return float(app.conf.task_time_limit or _DEFAULT_LIMIT_S)


def longest_run_s(app: Celery) -> float:
    """How long a periodic job's run lock must last: the hard time limit and a margin. A
    shorter lock lapsed under a run still going, and the next period's run started beside
    it."""
    return hard_limit_s(app) + LOCK_MARGIN_S


def dedup_window(schedule: str) -> float:
    """The period a job's runs are counted in: its interval, or a minute for a crontab."""
    return CRONTAB_WINDOW_S if len(schedule.split()) == 5 else float(schedule)


def period_slot(window_s: float, now: float | None = None) -> int:
    return int((time.time() if now is None else now) // window_s)


@contextmanager
def periodic_run(
    app: Celery, job: str, window_s: float, *, max_run_s: float, now: float | None = None
) -> Iterator[bool]:
    """Yield True if this process should run ``job`` now, False if it must skip.

    ``now`` (default: the current time) fixes the period slot; callers that record the
    slot pass the same value, so both always agree on the period.
    """
    settings = settings_of(app)
    slot = period_slot(window_s, now)
    if settings.broker_url and settings.broker_url.startswith(("redis://", "rediss://")):
        guard = _redis_guard(app, job, slot, window_s, max_run_s)
    else:
        guard = _file_guard(settings, job, slot)
    with guard as claimed:
        if not claimed:
            logger.info(
                "periodic job skipped: already run this period or still running",
                extra={"job": job, "slot": slot},
            )
        yield claimed


@contextmanager
def _redis_guard(
    app: Celery, job: str, slot: int, window_s: float, max_run_s: float
) -> Iterator[bool]:
    with app.connection_for_write() as connection:
        # kombu's Redis channel carries a redis-py client on the broker's URL.
        client = connection.default_channel.client
        with _redis_locks(client, job, slot, window_s, max_run_s) as claimed:
            yield claimed


@contextmanager
def _redis_locks(
    client: Any, job: str, slot: int, window_s: float, max_run_s: float
) -> Iterator[bool]:
    running = client.lock(
        f"{PREFIX}:{job}:running", timeout=max_run_s, blocking=False, thread_local=False
    )
    if not running.acquire(token=uuid.uuid4().hex):
        yield False
        return
    try:
        expiry = max(1, int(window_s * 2))
        yield bool(client.set(f"{PREFIX}:{job}:slot:{slot}", "1", nx=True, ex=expiry))
    finally:
        try:
            running.release()
        except Exception as exc:  # redis-py's LockNotOwnedError: it expired mid-run
            logger.warning(
                "periodic lock expired before the run ended",
                extra={"job": job, "error": repr(exc)},
            )


@contextmanager
def _file_guard(settings: Settings, job: str, slot: int) -> Iterator[bool]:
    folder = (settings.data_dir / "locks").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f"{job}.lock").open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield _claim_slot_file(folder / f"{job}.slot", slot)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _claim_slot_file(path: Path, slot: int) -> bool:
    try:
        last = int(path.read_text() or "-1")
    except (FileNotFoundError, ValueError):
        last = -1
    if last >= slot:
        return False
    replace_atomically(path, str(slot).encode())
    return True
