"""Listings that stay flat as the journal grows: event_time_blocks (upper bounds of
recorded_at and entry time per sealed block of positions) and ix_sessions_created

Revision ID: 0013
Revises: 0008
Create Date: 2026-11-24 04:40:00

`events --since` pages by position with a filter on recorded_at; no index serves both, so
it read the journal from position 1 up to its first match (41x slower at 1M events than at
10k). With this summary it starts in the first block whose bound reaches `since`. Empty at
first: readers fill it as they need it (core.query.timeblocks).

`list_sessions` without a tenant pages by (created_at, id): no index served that order, so
each page sorted every session (1.8x slower at 20k sessions than at 1k).
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch_op:
        batch_op.create_index("ix_sessions_created", ["created_at", "id"], unique=False)
    op.create_table(
        "event_time_blocks",
        sa.Column("block", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("max_recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("max_entry_ms", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("block"),
    )


def downgrade() -> None:
    op.drop_table("event_time_blocks")
    with op.batch_alter_table("sessions") as batch_op:
        batch_op.drop_index("ix_sessions_created")
