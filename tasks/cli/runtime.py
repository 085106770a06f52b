"""``sessionstore worker`` and ``sessionstore beat``: Celery with our app and settings.

Any further arguments go to Celery as they are (e.g. ``sessionstore worker -c 4 -l info``).
"""

from __future__ import annotations

import os
from typing import Any

import typer

from tasks.cli.common import MetricsAddrOption, load_settings, metrics_port_option, new_app

cli = new_app()

_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


@cli.command("worker", context_settings=_PASS_THROUGH)
def worker(
    ctx: typer.Context,
    metrics_port: int | None = metrics_port_option(
        "Serve Prometheus /metrics on this port (all processes)."
    ),
    metrics_addr: str = MetricsAddrOption,
) -> None:
    """Run a Celery worker for the sessionstore queue.

    No --json: a long-running process whose output is Celery's own log (use
    `sessionstore queue status --json` or `health --json` to query it)."""
    from tasks.app import get_app

    settings = load_settings()  # fail early, in one line, on bad configuration
    if metrics_port is not None:
        from tasks.metrics import serve_process_metrics

        serve_process_metrics(settings, metrics_port, metrics_addr, name=str(os.getpid()))
    _celery(get_app(), ["worker", "--loglevel=INFO", *ctx.args])


@cli.command("beat", context_settings=_PASS_THROUGH)
def beat(ctx: typer.Context) -> None:
    """Run Celery beat: blob GC, artifact expiry and the fork-copy reconciler.

    No --json: a long-running process whose output is Celery's own log (use
    `sessionstore maintenance-runs --json` for what its jobs did)."""
    from tasks.app import get_app

    settings = load_settings()
    schedule = settings.data_dir.resolve() / "celerybeat-schedule"
    schedule.parent.mkdir(parents=True, exist_ok=True)
    _celery(get_app(), ["beat", "--loglevel=INFO", f"--schedule={schedule}", *ctx.args])


def _celery(app: Any, argv: list[str]) -> None:
    """``celery ARGV`` for ``app``, exiting with its status. ``app.start`` and
    ``app.worker_main`` drop it (click's ``main`` returns it, out of standalone mode, and
    neither passes it on): a worker that gave up, which ``tasks.worker`` makes exit
    non-zero, exited 0 here, and a supervisor restarting only failed processes left it."""
    from celery.bin.celery import celery

    celery.params[0].default = app  # as app.start does: the app, without -A
    try:
        code = celery.main(args=argv, standalone_mode=False)
    finally:
        celery.params[0].default = None
    if isinstance(code, int) and code:
        raise typer.Exit(code)
