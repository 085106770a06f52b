"""``sessionstore worker`` and ``sessionstore beat``: Celery with our app and settings.

Any further arguments go to Celery as they are (e.g. ``sessionstore worker -c 4 -l info``).
"""

from __future__ import annotations

import os

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
    get_app().worker_main(["worker", "--loglevel=INFO", *ctx.args])


@cli.command("beat", context_settings=_PASS_THROUGH)
def beat(ctx: typer.Context) -> None:
    """Run Celery beat: blob GC, artifact expiry and the fork-copy reconciler.

    No --json: a long-running process whose output is Celery's own log (use
    `sessionstore maintenance-runs --json` for what its jobs did)."""
    from tasks.app import get_app

    settings = load_settings()
    schedule = settings.data_dir.resolve() / "celerybeat-schedule"
    schedule.parent.mkdir(parents=True, exist_ok=True)
    get_app().start(["beat", "--loglevel=INFO", f"--schedule={schedule}", *ctx.args])
