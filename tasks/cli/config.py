"""``sessionstore settings``: the effective configuration, or the documented table."""

from __future__ import annotations

import typer

from tasks.cli.common import JsonOption, load_settings, new_app, print_fields, print_json

cli = new_app()


@cli.command("settings")
def settings(
    markdown: bool = typer.Option(False, "--markdown", help="The README's table of variables."),
    as_json: bool = JsonOption,
) -> None:
    """Show the effective settings (from SESSIONSTORE_* variables) and derived URLs
    (passwords hidden)."""
    from core.settings import settings_markdown
    from core.urls import hide_password
    from tasks.app import celery_broker_url  # not celery_config: it makes the queue's folders

    if markdown:
        typer.echo(settings_markdown())
        return
    current = load_settings()
    values = {
        **current.model_dump(mode="json"),
        "resolved_database_url": current.resolved_database_url,
        "resolved_blob_url": current.resolved_blob_url,
        "resolved_artifact_root": str(current.resolved_artifact_root),
        "celery_broker_url": celery_broker_url(current),
    }
    # every text value: a URL's password is shown nowhere (a dump gets pasted into issues)
    values = {k: hide_password(v) if isinstance(v, str) else v for k, v in values.items()}
    if as_json:
        print_json(values)
        return
    print_fields(values)
