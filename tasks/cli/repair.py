"""``sessionstore sessions repair``: finish or roll back moves a crash left half done."""

from __future__ import annotations

from tasks.cli.common import JsonOption, console, open_store, print_json
from tasks.cli.sessions import sessions_app


@sessions_app.command("repair")
def repair(as_json: bool = JsonOption) -> None:
    """Complete (the directory was renamed) or roll back (it was not) every interrupted move."""
    with open_store() as store:
        repaired = store.repair_moves()
    if as_json:
        print_json({"repaired": [r.to_dict() for r in repaired]})
        return
    if not repaired:
        console.print("nothing to repair")
    for r in repaired:
        console.print(
            f"{r.session_id}: move {r.from_tenant} -> {r.to_tenant} {r.outcome}",
            markup=False,
            highlight=False,
        )
