"""``sessionstore gc``, ``expire`` and ``maintenance-runs``: dry runs unless ``--apply``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import typer

from tasks.cli.common import (
    JsonOption,
    add_row,
    console,
    err_console,
    new_app,
    new_table,
    open_store,
    plain,
    print_json,
)

if TYPE_CHECKING:
    from rich.progress import Progress

cli = new_app()

ApplyOption = typer.Option(False, "--apply", help="Delete for real (default: a dry run).")
BatchOption = typer.Option(1000, "--batch-size", min=1, max=100_000, help="Rows per page.")
_PHASES = {
    "blobs": "registered blobs",
    "files": "blob files (orphans, temporary files)",
    "artifacts": "expired artifacts",
    "rollup": "stats rollup (blocks of 256 events; once, then what is new)",
}


class _Bars:
    """A core ``Progress`` callback drawing one rich bar per phase (on stderr)."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: dict[str, Any] = {}

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        if phase not in self.tasks:
            self.tasks[phase] = self.progress.add_task(_PHASES.get(phase, phase), total=total)
        self.progress.update(self.tasks[phase], completed=done, total=total)


@contextmanager
def _bars(enabled: bool) -> Iterator[_Bars]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=not enabled or not err_console.is_terminal,
    )
    with progress:
        yield _Bars(progress)


def _print_report(title: str, report: dict[str, Any], applied: bool) -> None:
    table = new_table("", "", title=title, show_header=False)
    for key, value in report.items():
        if key not in ("errors", "sample"):
            add_row(table, key, value)
    console.print(table)
    for line in report.get("errors", []):
        err_console.print(plain(f"error: {line}"), highlight=False, soft_wrap=True)
    if not applied:
        console.print("dry run: nothing was deleted; run again with --apply to delete")


@cli.command("gc")
def gc(
    apply: bool = ApplyOption,
    grace: float | None = typer.Option(
        None,
        "--grace",
        min=0,
        help="Keep unreferenced blobs written less than this many seconds ago "
        "(default: SESSIONSTORE_GC_GRACE_SECONDS).",
    ),
    batch_size: int = BatchOption,
    as_json: bool = JsonOption,
) -> None:
    """Collect blobs no event references, and blob files that were never registered."""
    with open_store() as store, _bars(not as_json) as bars:
        report = store.gc_blobs(apply=apply, grace=grace, batch_size=batch_size, progress=bars)
    result = report.to_dict()
    if as_json:
        print_json(result)
    else:
        _print_report("blob GC", result, apply)
    if report.unavailable:  # what it did is reported; the exit says storage, as a raise would
        from tasks.cli.failures import ExitCode

        raise typer.Exit(code=ExitCode.STORAGE_UNAVAILABLE)
    if report.error_count:
        raise typer.Exit(code=1)


@cli.command("expire")
def expire(
    apply: bool = ApplyOption, batch_size: int = BatchOption, as_json: bool = JsonOption
) -> None:
    """Remove oversized-output artifacts past their TTL (files and rows), stale staging
    files, and the directories of deleted sessions their delete could not remove; mark
    tool outputs a killed writer left unfinished as truncated."""
    with open_store() as store, _bars(not as_json) as bars:
        report = store.expire_artifacts(apply=apply, batch_size=batch_size, progress=bars)
    result = report.to_dict()
    if as_json:
        print_json(result)
    else:
        _print_report("artifact expiry", result, apply)
    if report.errors:
        raise typer.Exit(code=1)


# core.maintenance.runs.JOBS, named here: importing it loads SQLAlchemy for --help (a test
# keeps the two the same)
JOBS = ("gc_blobs", "expire_artifacts", "reconcile_forks")
Job = StrEnum("Job", {job: job for job in JOBS})  # type: ignore[misc]  # (a bad --job: exit 2)


@cli.command("maintenance-runs")
def maintenance_runs(
    job: Job | None = typer.Option(None, help="Only this job's runs."),
    limit: int = typer.Option(20, min=1, max=10_000),
    as_json: bool = JsonOption,
) -> None:
    """The latest periodic maintenance runs: ran or skipped, and what they did."""
    with open_store() as store:
        runs = store.maintenance_runs.recent(job=job and job.value, limit=limit)
    if as_json:
        print_json([r.to_dict() for r in runs])
        return
    table = new_table("started", "job", "ran", "seconds", "deleted", "errors")
    for run in runs:
        report = (run.report or {}).get("report") or {}
        add_row(
            table,
            run.started_at.strftime("%Y-%m-%d %H:%M:%S"),
            run.job,
            "yes" if run.ran else "skipped",
            f"{(run.finished_at - run.started_at).total_seconds():.2f}",
            str(report.get("deleted", "")),
            str(report.get("error_count", len(report.get("errors", [])) or "")),
        )
    console.print(table)
