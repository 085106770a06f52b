"""session_moves: the intent of a session move, recorded before its directory is renamed

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 20:45:00

A move commits this row first, renames the artifact directory, then updates the session and
deletes the row in one transaction. A row left behind marks a move interrupted by a crash;
the fork reconciler and ``sessionstore sessions repair`` complete or roll it back.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "session_moves",
        sa.Column("session_id", sa.String(length=36), nullable=False),
        sa.Column("from_tenant", sa.String(length=128), nullable=False),
        sa.Column("to_tenant", sa.String(length=128), nullable=False),
        sa.Column("cwd", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("session_id"),
    )


def downgrade() -> None:
    op.drop_table("session_moves")
