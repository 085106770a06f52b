"""The Celery app, configured from ``Settings`` by a factory.

``celery -A tasks.app worker`` works: the module attribute ``app`` is created on first
access (PEP 562), and even then its configuration (and ``Settings``) is only built when
Celery first reads it. Tests and the embedded mode call ``create_app(settings)``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

from celery import Celery, shared_task
from celery.schedules import crontab, schedule

from core.broker import TRANSPORT as EMBEDDED_TRANSPORT
from core.settings import Settings, crontab_period, parse_schedule, warn_unknown_variables
from core.urls import EMBEDDED_BROKER_URL
from tasks.results import polling_redis_url

TASK_MODULES = ["tasks.writes", "tasks.maintenance", "tasks.forks", "tasks.rehydrate"]
QUEUE = "sessionstore"
REDIS_URLS = ("redis://", "rediss://")
# Backoff between attempts to reach the broker, for publishing and for (re)connecting.
_RECONNECT = {"interval_start": 0.0, "interval_step": 0.5, "interval_max": 2.0}


def sessionstore_task(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``shared_task`` with a type (Celery ships none): tasks register on every app.

    Every task's messages pass the consumer's check before the pool (``tasks.consumer``).
    """
    options.setdefault("Strategy", "tasks.consumer:checked_strategy")
    decorator: Callable[[Callable[..., Any]], Any] = shared_task(**options)
    return decorator


class _SettingsHolder:
    """Builds ``Settings()`` from the environment only when first needed."""

    def __init__(self, settings: Settings | None) -> None:
        self._settings = settings

    def get(self) -> Settings:
        if self._settings is None:
            warn_unknown_variables()
            self._settings = Settings()
        return self._settings


def settings_of(app: Celery) -> Settings:
    holder: _SettingsHolder = app.sessionstore_settings
    return holder.get()


def embedded_broker_dir(settings: Settings) -> Path:
    return (settings.data_dir / "queue").resolve()


def celery_broker_url(settings: Settings) -> str:
    """The broker URL Celery is given (the embedded broker's when none is set)."""
    return settings.broker_url or EMBEDDED_BROKER_URL


def _broker(settings: Settings) -> tuple[str, dict[str, Any]]:
    if settings.broker_url:
        options: dict[str, Any] = {}
        if settings.broker_url.startswith(REDIS_URLS):
            # kombu returns a dead worker's unacked messages in periodic sweeps, by default
            # only every ~100 s and blocked for 5 minutes if the worker died holding the
            # sweep mutex: tie both to the visibility timeout instead.
            visibility = settings.task_visibility_timeout
            options = {
                "unacked_restore_interval": max(1, min(60, visibility // 10)),
                "unacked_restore_throttle": 1,
                "unacked_mutex_expire": max(5, min(60, visibility // 2)),
                "socket_keepalive": True,
                "socket_connect_timeout": 10,
                # kombu bounds every (re)connection by this total time (by default the
                # 4 s connect timeout, which made a producer give up after ~5 s).
                "connect_retries_timeout": settings.publish_retry_seconds,
                **_RECONNECT,
            }
        return settings.broker_url, options
    # Embedded: kombu's filesystem transport in the data dir. Real messages, acks and
    # retries across processes, no server; not crash-durable like Redis with AOF.
    folder = embedded_broker_dir(settings)
    for sub in ("in", "processed", "control"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    return EMBEDDED_BROKER_URL, {
        "data_folder_in": str(folder / "in"),
        "data_folder_out": str(folder / "in"),
        "processed_folder": str(folder / "processed"),
        "control_folder": str(folder / "control"),
        "store_processed": False,
        "polling_interval": 0.02,
    }


def _result_backend(settings: Settings) -> str:
    url = settings.result_backend
    if not url and settings.broker_url and settings.broker_url.startswith(REDIS_URLS):
        url = settings.broker_url
    if url and url.startswith(REDIS_URLS):
        return polling_redis_url(url)
    if url:
        return url
    return f"db+sqlite:///{(settings.data_dir / 'results.db').resolve()}"


def _every(seconds: float) -> schedule:
    return schedule(run_every=seconds)


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """Periodic jobs; each expires after one period, so a backlog never piles up."""

    def job(task: str, every: float | crontab) -> dict[str, Any]:
        if isinstance(every, crontab):
            run_every, expires = every, crontab_period(every)
        else:
            run_every, expires = _every(every), every
        options: dict[str, Any] = {"queue": QUEUE}
        if expires is not None:  # None: a crontab that never runs (celery refuses those)
            options["expires"] = expires
        return {"task": task, "schedule": run_every, "options": options}

    return {
        "gc-blobs": job("sessionstore.gc_blobs", parse_schedule(settings.gc_schedule)),
        "expire-artifacts": job(
            "sessionstore.expire_artifacts", parse_schedule(settings.expire_schedule)
        ),
        "reconcile-forks": job(
            "sessionstore.reconcile_forks", parse_schedule(settings.reconcile_schedule)
        ),
    }


def _publish_attempts(seconds: float) -> int:
    """Retries whose backoff (0, 0.5, 1, 1.5, then 2 s each) adds up to ``seconds``."""
    start, step, most = (_RECONNECT[k] for k in ("interval_start", "interval_step", "interval_max"))
    waited, attempts = 0.0, 0
    while waited < seconds and start + attempts * step < most:  # the growing waits
        waited += start + attempts * step
        attempts += 1
    if waited < seconds:  # then the longest wait each time
        attempts += math.ceil((seconds - waited) / most)
    return attempts


def celery_config(settings: Settings) -> dict[str, Any]:
    broker_url, transport_options = _broker(settings)
    visibility = settings.task_visibility_timeout
    # The longest task must finish well inside the visibility timeout, or Redis would
    # hand its message to a second worker while the first is still running it.
    hard_limit = max(5, min(900, visibility // 2))
    return {
        "broker_url": broker_url,
        # The embedded broker: kombu's filesystem transport without its races (core.broker).
        "broker_transport": None if settings.broker_url else EMBEDDED_TRANSPORT,
        "result_backend": _result_backend(settings),
        # Ack after the task ran, so a crash mid-task redelivers it (writes are idempotent).
        "task_acks_late": True,
        # A pool process killed mid-task (SIGKILL, OOM) requeues its message.
        "task_reject_on_worker_lost": True,
        # One message reserved per process: a crash strands at most that many.
        "worker_prefetch_multiplier": 1,
        # Unacked messages come back after this long; same value for broker and results.
        "broker_transport_options": {"visibility_timeout": visibility, **transport_options},
        "result_backend_transport_options": {"visibility_timeout": visibility},
        # Hard/soft time limits below the visibility timeout (see above). The write task
        # retries the soft limit (tasks.writes); a run killed at the hard limit (stuck
        # where the soft one cannot reach it, in C) goes back to the queue instead of
        # being acked with a FAILURE and lost: Celery's default acks a timed-out message.
        # A write back too often is dead-lettered (tasks.deliveries counts redeliveries).
        "task_time_limit": hard_limit,
        "task_soft_time_limit": int(hard_limit * 0.8),
        "task_acks_on_timeout": False,
        # Publishing survives a broker restart: SESSIONSTORE_PUBLISH_RETRY_SECONDS of retries.
        "task_publish_retry": True,
        "task_publish_retry_policy": {
            "max_retries": _publish_attempts(settings.publish_retry_seconds),
            **_RECONNECT,
        },
        # Keep reconnecting to the broker, including at startup.
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        # Running tasks are cancelled (and redelivered) when the broker connection drops.
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        # Soft shutdown: on a warm stop, running tasks get this long to finish first.
        "worker_soft_shutdown_timeout": 10.0,
        "worker_enable_soft_shutdown_on_idle": True,
        # Task events on, for flower and `celery events`.
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        # JSON only: producers in any language can send tasks by name.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_expires": 24 * 3600,
        "task_default_queue": QUEUE,
        "timezone": "UTC",
        "enable_utc": True,
        "beat_schedule": beat_schedule(settings),
        "worker_hijack_root_logger": False,
        # Messages that fail before a task runs are dead-lettered, not logged and acked.
        "worker_consumer": "tasks.consumer:Consumer",
    }


class SessionStoreCelery(Celery):  # type: ignore[misc]
    """Celery, with a ``celery worker`` that fails loudly (``tasks.worker``)."""

    @cached_property
    def Worker(self) -> Any:
        return self.subclass_with_self("tasks.worker:Worker")


def check_broker(app: Celery) -> str:
    """Connect to the app's broker once (no retries): a health check."""
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1)
        return f"broker {conn.as_uri()} answers"


def create_app(settings: Settings | None = None) -> Celery:
    """A new app; ``settings`` defaults to ``Settings()`` read when first configured."""
    # Task modules register (shared_task) before any app finalizes; imported here, not at
    # module top, because they import this module.
    for module in TASK_MODULES:
        importlib.import_module(module)
    app = SessionStoreCelery("sessionstore", include=TASK_MODULES, set_as_current=False)
    holder = _SettingsHolder(settings)
    app.sessionstore_settings = holder
    app.add_defaults(lambda: celery_config(holder.get()))
    return app


_default: Celery | None = None


def get_app() -> Celery:
    """The process's default app (environment settings), created on first use."""
    global _default
    if _default is None:
        _default = create_app()
        _default.set_default()
    return _default


def __getattr__(name: str) -> Celery:
    if name in ("app", "celery"):
        return get_app()
    raise AttributeError(name)
