"""artifacts.inherited: the rows a fork got at its creation, marked, not judged by clocks

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-29 05:00:00

A fork's artifact copy reports an inherited artifact whose file the parent no longer holds
("changed or removed in the parent"). Which of the fork's rows were inherited was judged by
two clocks: a row's ``created_at`` (the clock of the host that allocated it) against the
fork's ``created_at`` (the forking host's). An artifact the fork allocated itself before its
first append, on a host whose clock is behind the forking host's, passed for an inherited
one, and the fork's copy failed on it. The rows a fork copies from its parent at its
creation are now marked ``inherited`` in that transaction, and a row the fork writes anew
(a file put again under the same name) is its own again.

Existing rows: the rows of a fork whose copy is unfinished (pending or failed: the only
ones a copy reads the mark of; a finished copy never runs again) are marked as the old
judgement had it (created at or before the fork point and not after the fork's creation),
so nothing changes for them; other rows read as their session's own.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0025"
down_revision: str | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # plain ALTER TABLE on both backends: a batch rebuild on SQLite would drop AUTOINCREMENT
    op.add_column(
        "artifacts",
        sa.Column("inherited", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    op.execute(
        "UPDATE artifacts SET inherited = "
        + ("true" if op.get_bind().dialect.name == "postgresql" else "1")
        + " WHERE EXISTS (SELECT 1 FROM sessions s WHERE s.id = artifacts.session_id"
        " AND s.parent_id IS NOT NULL AND s.forked_from_seq IS NOT NULL"
        " AND s.copy_status IN ('pending', 'failed')"
        " AND artifacts.created_seq <= s.forked_from_seq AND artifacts.created_at <= s.created_at)"
    )


def downgrade() -> None:
    op.drop_column("artifacts", "inherited")  # SQLite >= 3.35 drops columns in place
