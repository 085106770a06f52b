"""``sessionstore health``: are the database, broker, blob and artifact storage usable?"""

from __future__ import annotations

import typer

from tasks.cli.common import JsonOption, console, load_settings, new_app, plain, print_json

cli = new_app()


@cli.command("health")
def health(
    as_json: bool = JsonOption,
    timeout: float = typer.Option(5.0, "--timeout", min=0.1, max=3600, help="Seconds per check."),
) -> None:
    """Check the database (schema current), broker, blob and artifact storage; exit 1 and
    name what failed if any check does (compose uses this as the healthcheck)."""
    from core.fsio import yet_to_make
    from core.health import run_checks, storage_checks
    from tasks.app import check_broker, create_app, embedded_broker_dir

    settings = load_settings()
    checks = storage_checks(settings)

    def broker() -> str:
        if not settings.broker_url:  # the embedded broker: its folder is not made by a check
            missing = yet_to_make(embedded_broker_dir(settings), "embedded broker folder")
            if missing is not None:
                return missing
        return check_broker(create_app(settings))

    checks["broker"] = broker
    results = run_checks(checks, timeout_s=timeout)
    failed = [r.name for r in results if not r.ok]
    if as_json:
        print_json({"ok": not failed, "checks": [r.to_dict() for r in results]})
    else:
        for r in results:
            mark = "[green]ok[/]" if r.ok else "[red]FAILED[/]"
            # the detail may quote an error message: literal text, never markup
            console.print(f"{r.name:<10} {mark}  ", plain(r.detail), sep="", highlight=False)
    if failed:
        raise typer.Exit(code=1)
