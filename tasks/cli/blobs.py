"""``sessionstore blobs verify``: find missing, corrupt and unregistered blob files."""

from __future__ import annotations

from pathlib import Path

import typer

from tasks.cli.common import (
    JsonOption,
    console,
    err_console,
    new_app,
    new_table,
    open_store,
    print_json,
)
from tasks.cli.maintenance import _bars

cli = new_app()
blobs_app = new_app(help="The blob store: verify (and repair).")
cli.add_typer(blobs_app, name="blobs")


@blobs_app.command("verify")
def verify(
    repair_from: Path | None = typer.Option(
        None,
        "--repair-from",
        exists=True,
        file_okay=False,
        dir_okay=True,
        help="A directory of known-good blobs to re-write missing and corrupt ones from.",
    ),
    as_json: bool = JsonOption,
) -> None:
    """Check every registered blob against its hash; quarantine corrupt files (moved to
    <blob root>/corrupt/); report missing and unregistered files, and symlinks under the
    blob root (never followed; the other blobs are still checked). Exit 1 if any blob is
    left missing or corrupt, or a symlink was found."""
    from core.blobs.verify import verify_blobs

    with open_store() as store, _bars(not as_json) as bars:
        report = verify_blobs(store.blobs, repair_from=repair_from, progress=bars)
    result = report.to_dict()
    if as_json:
        print_json(result)
    else:
        table = new_table("", "", title="blob verify", show_header=False)
        for key in ("checked", "ok", "missing", "corrupt", "quarantined", "repaired", "unrepaired"):
            table.add_row(key, str(result.get(f"{key}_count", result.get(key))))
        table.add_row("unregistered", str(result["unregistered_count"]))
        table.add_row("symlinks", str(result["symlinks_count"]))
        console.print(table)
        for kind, label in (
            ("missing", "missing"),
            ("corrupt", "corrupt"),
            ("unrepaired", "unrepaired"),
            ("symlinks", "symlink"),
        ):
            for value in report_list(result, kind):
                err_console.print(
                    f"{label}: {value}", markup=False, highlight=False, soft_wrap=True
                )
    if not report.healthy:
        raise typer.Exit(code=1)


def report_list(result: dict[str, object], kind: str) -> list[str]:
    value = result.get(kind)
    return [str(v) for v in value] if isinstance(value, list) else []
