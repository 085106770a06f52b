"""events.payload: exact JSON text (PostgreSQL ``json`` instead of ``jsonb``)

Revision ID: 0009
Revises: 0006
Create Date: 2026-11-23 20:30:00

What is read must be what was written (DESIGN invariant 11), and ``jsonb`` cannot promise
that: it reorders object keys, reads ``-0.0`` back as ``0.0`` and integral floats such as
``1e16`` as integers. SQLite already stores the text. The choice, among the ways to keep the
exact text on PostgreSQL:

- ``json`` (chosen): PostgreSQL keeps the input text as is and validates it; the ``->``,
  ``->>``, ``#>>``, ``json_typeof`` and ``json_array_elements`` functions work on it
  directly, so the BI views and ``core.query.analytics`` keep working on the same column
  (they parse the text per access instead of reading jsonb's binary form, a cost paid by
  analytical queries, not by appends or reads). Appends get cheaper: the server validates
  the text instead of building jsonb from it.
- ``text`` or ``bytea`` plus a ``jsonb`` copy for queries: the BI views read most of the
  payload (message text, tool calls, usage), so the copy would be nearly the whole event
  again; storage doubles (the target is 0.40x the raw JSON) and every append pays for both.
- ``text`` and views that cast to ``jsonb``: PostgreSQL inlines the cast at every use in a
  view, so a row is parsed once per referenced field anyway; ``json`` gives the same
  access without the casts and with validation at write.

TOAST compression stays PostgreSQL's default, pglz. Measured on the 200-turn session of
issue 19 (``python -m bench.session200 --storage-variants``, bench/RESULTS.md): lz4 stored
the payloads 5% larger and read them back within the noise of pglz; a lower
``toast_tuple_target`` (256, 128) made the table larger, not smaller. PostgreSQL 15 has no
zstd TOAST compression. The existing rows are rewritten once, here (an ACCESS EXCLUSIVE lock
on ``events`` for its duration); their text is PostgreSQL's rendering of the old jsonb,
which is all that was left of the original.

The BI views of 0002 are recreated over the ``json`` column with the ``json_*`` functions;
their columns keep their names and meaning (``bi_events.payload`` and
``bi_tool_calls.arguments`` are now ``json``, exact, instead of ``jsonb``).

The downgrade turns the payloads back into ``jsonb``, losing their exact text for good (an
upgrade again cannot restore it), while the snapshots folded from that text would survive
it: state from a snapshot would then differ from state from scratch. So a downgrade of a
journal holding events is refused (``DowngradeRefused``, nothing changed) unless forced
(``sessionstore db downgrade REV --force``); forced, it deletes the snapshots, which the
older code folds again from the rewritten events.
"""

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from alembic import op

revision: str = "0009"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# jsonb spelling in 0002 -> json spelling, for the same views over the json column
_TO_JSON = (
    ("jsonb_typeof", "json_typeof"),
    ("jsonb_array_elements", "json_array_elements"),
    ("'[]'::jsonb", "'[]'::json"),
)


def _bi_views() -> ModuleType:
    """Migration 0002, whose view definitions (and their comments) are the source."""
    path = Path(__file__).with_name("0002_bi_views.py")
    spec = importlib.util.spec_from_file_location("_sessionstore_0002_bi_views", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _over_json(statement: str) -> str:
    for old, new in _TO_JSON:
        statement = statement.replace(old, new)
    return statement


def _recreate_views(module: ModuleType, *, exact: bool) -> None:
    for statement in (module.BI_EVENTS, module.BI_MESSAGES, module.BI_TOOL_CALLS):
        op.execute(_over_json(statement) if exact else statement)
    op.execute(module.BI_SESSIONS)
    for view, (about, columns) in module.COMMENTS.items():
        op.execute(f"COMMENT ON VIEW {view} IS {module._quote(about)}")
        for column, text in columns.items():
            op.execute(f"COMMENT ON COLUMN {view}.{column} IS {module._quote(text)}")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite stores the payload as JSON text already
    views = _bi_views()
    for view in views.VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {view}")
    op.execute("ALTER TABLE events ALTER COLUMN payload TYPE json USING payload::json")
    _recreate_views(views, exact=True)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    from core.migrate import refuse_downgrade

    refuse_downgrade(
        "0009",
        "SELECT count(*) FROM events",
        lambda events: f"{events} event(s) would be rewritten as jsonb, which reorders "
        "object keys, reads -0.0 as 0.0 and integral floats such as 1e16 as integers; an "
        "upgrade again cannot restore them. Downgrade with --force (`alembic -x force=1`) "
        "to accept that: the snapshots are then deleted, to be folded again from the "
        "rewritten events",
    )
    # Folded from the exact payloads: kept, they would disagree with a fold of the rewritten
    # ones (DESIGN invariant 11); the older code folds them again on demand.
    op.execute("DELETE FROM snapshots")
    views = _bi_views()
    for view in views.VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {view}")
    op.execute("ALTER TABLE events ALTER COLUMN payload TYPE jsonb USING payload::jsonb")
    _recreate_views(views, exact=False)
