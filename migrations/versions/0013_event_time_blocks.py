"""event_time_blocks: an upper bound of recorded_at per sealed block of positions

Revision ID: 0013
Revises: 0008
Create Date: 2026-11-24 04:40:00

`events --since` pages by position with a filter on recorded_at; no index serves both, so
it read the journal from position 1 up to its first match (41x slower at 1M events than at
10k). With this summary it starts in the first block whose bound reaches `since`. Empty at
first: readers fill it as they need it (core.query.timeblocks).
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "event_time_blocks",
        sa.Column("block", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("max_recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("block"),
    )


def downgrade() -> None:
    op.drop_table("event_time_blocks")
