"""events.inherited: a fork's copies of its parent's events, so analytics count them once

Revision ID: 0008
Revises: 0012
Create Date: 2026-11-23 21:30:00

A fork copies its parent's events 1..forked_from_seq into its own rows (``Journal.
copy_events``). Counted per session, every fork counts them again: tokens were
double-counted in ``sessionstore stats`` and in the BI views. The copies are now marked
``inherited``; stats and the BI aggregates leave them out unless asked.

Existing rows: a fork's events up to ``forked_from_seq`` are the copies (they were written
by the fork itself, in the fork's transaction), everything else is the session's own.

The BI views of 0002 (over ``json`` since 0009) are recreated with an ``inherited`` column
on ``bi_events``, ``bi_messages`` and ``bi_tool_calls``; ``bi_sessions`` sums only the
session's own messages and gains ``inherited_events``. The downgrade restores 0009's views.
"""

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _load(filename: str) -> ModuleType:
    path = Path(__file__).with_name(filename)
    spec = importlib.util.spec_from_file_location(f"_sessionstore_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (view, text after which the column is inserted, the column): the SELECT lists of 0002
_INHERITED_AFTER = "       e.seq,\n"
_INHERITED = "       e.inherited,\n"

_OWN_ONLY = (
    "    FROM bi_messages\n    GROUP BY session_id\n",
    "    FROM bi_messages\n    WHERE NOT inherited\n    GROUP BY session_id\n",
)
_INHERITED_EVENTS = (
    "       s.head_seq AS events,\n",
    "       s.head_seq AS events,\n"
    "       CASE WHEN s.parent_id IS NULL THEN 0\n"
    "            ELSE COALESCE(s.forked_from_seq, 0) END AS inherited_events,\n",
)

COMMENTS = {
    "bi_events": {"inherited": "A fork's copy of its parent's event: leave out to count once."},
    "bi_messages": {
        "inherited": "A fork's copy of its parent's message: sum tokens WHERE NOT inherited."
    },
    "bi_tool_calls": {"inherited": "A fork's copy of its parent's call."},
    "bi_sessions": {
        "inherited_events": "Events copied from the parent at the fork (included in events).",
        "messages": "The session's own messages (not inherited from a parent).",
        "input_tokens": "usage.input over the session's own messages.",
        "output_tokens": "usage.output over the session's own messages.",
        "total_tokens": "usage.totalTokens over the session's own messages.",
        "cost": "Cost over the session's own messages.",
    },
}


def _with_inherited(statement: str) -> str:
    assert statement.count(_INHERITED_AFTER) == 1, "0002's SELECT list changed"
    return statement.replace(_INHERITED_AFTER, _INHERITED_AFTER + _INHERITED)


def _bi_sessions_own(statement: str) -> str:
    for old, new in (_OWN_ONLY, _INHERITED_EVENTS):
        assert statement.count(old) == 1, "0002's bi_sessions changed"
        statement = statement.replace(old, new)
    return statement


def _drop_views(bi: ModuleType) -> None:
    for view in bi.VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {view}")


def upgrade() -> None:
    # plain ALTER TABLE on both backends: a batch rebuild on SQLite would drop AUTOINCREMENT
    op.add_column(
        "events", sa.Column("inherited", sa.Boolean(), nullable=False, server_default=sa.false())
    )
    op.execute(
        "UPDATE events SET inherited = "
        + ("true" if op.get_bind().dialect.name == "postgresql" else "1")
        + " WHERE EXISTS (SELECT 1 FROM sessions s WHERE s.id = events.session_id"
        " AND s.parent_id IS NOT NULL AND events.seq <= s.forked_from_seq)"
    )
    if op.get_bind().dialect.name != "postgresql":
        return  # the BI views are PostgreSQL's
    bi, exact = _load("0002_bi_views.py"), _load("0009_events_payload_exact_json.py")
    _drop_views(bi)
    for statement in (bi.BI_EVENTS, bi.BI_MESSAGES, bi.BI_TOOL_CALLS):
        op.execute(_with_inherited(exact._over_json(statement)))
    op.execute(_bi_sessions_own(bi.BI_SESSIONS))
    comments = {view: dict(columns) for view, (_, columns) in bi.COMMENTS.items()}
    for view, columns in COMMENTS.items():
        comments[view].update(columns)
    for view, (about, _) in bi.COMMENTS.items():
        if view == "bi_sessions":
            about = "One row per session, with totals over its own messages (every branch)."
        op.execute(f"COMMENT ON VIEW {view} IS {bi._quote(about)}")
        for column, text in comments[view].items():
            op.execute(f"COMMENT ON COLUMN {view}.{column} IS {bi._quote(text)}")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        bi, exact = _load("0002_bi_views.py"), _load("0009_events_payload_exact_json.py")
        _drop_views(bi)
    op.drop_column("events", "inherited")  # SQLite >= 3.35 drops columns in place
    if op.get_bind().dialect.name == "postgresql":
        exact._recreate_views(bi, exact=True)
