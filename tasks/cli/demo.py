"""``sessionstore demo``: the whole system, by default in a fresh temporary data directory.

Without ``--use-settings`` the demo never reads SESSIONSTORE_* variables: it cannot touch a
user's database, blobs or broker (it runs GC and expiry).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import typer

from tasks.cli.common import JsonOption, check_tenant, confirm, load_settings, new_app

cli = new_app()


@cli.command("demo")
def demo(
    tenant: str = typer.Option("demo", callback=check_tenant, help="Tenant of the demo sessions."),
    keep: bool = typer.Option(False, "--keep", help="Keep the temporary data directory."),
    use_settings: bool = typer.Option(
        False,
        "--use-settings",
        help="Run against the configured database and broker (asks first: it runs GC).",
    ),
    yes: bool = typer.Option(False, "--yes", "-y", help="With --use-settings: do not ask."),
    as_json: bool = JsonOption,
) -> None:
    """Write a realistic agent session through the queue, fork it, clean up, rebuild it.

    By default everything lives in a fresh temporary data directory with the embedded
    defaults (SQLite, file blobs, filesystem broker), removed afterwards unless --keep.
    """
    from core.settings import Settings
    from core.urls import hide_password
    from tasks.cli import demo_script

    if use_settings:
        settings = load_settings()
        where = hide_password(settings.resolved_database_url)
        broker = hide_password(settings.broker_url or "the embedded broker")
        confirm(
            f"run the demo against {where} and {broker}? It writes sessions and runs blob "
            "GC and artifact expiry there.",
            yes=yes,
        )
        demo_script.run(settings, tenant, as_json=as_json)
        return
    data_dir = Path(tempfile.mkdtemp(prefix="sessionstore-demo-"))
    typer.echo(f"demo data dir: {data_dir}", err=True)
    defaults = {
        name: field.get_default(call_default_factory=True)
        for name, field in Settings.model_fields.items()
    }
    # Built from defaults only: no SESSIONSTORE_* variable reaches the demo.
    settings = Settings.model_validate({**defaults, "data_dir": data_dir})
    try:
        demo_script.run(settings, tenant, as_json=as_json)
    finally:
        if keep:
            typer.echo(f"kept the demo data dir: {data_dir}", err=True)
        else:
            shutil.rmtree(data_dir, ignore_errors=True)
            typer.echo(f"removed the demo data dir {data_dir} (--keep keeps it)", err=True)
