"""stats() that does not read the journal: event_rollups (per session and recorded day, the
events grouped by type and model, with counts, bytes and token sums) and event_rollup_blocks
(which sealed blocks of positions are counted in it)

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-24 16:30:00

stats() aggregated the whole journal on every call (35 s at a million events). It now reads
the rollup for the days wholly inside its time range and the live events for the rest.
Empty at first: readers fill it as they need it (core.query.rollups).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "event_rollup_blocks",
        sa.Column("block", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("rolled", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("block"),
    )
    op.create_table(
        "event_rollups",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("day", sa.String(length=10), nullable=False),
        sa.Column("session_id", sa.String(length=36), nullable=False),
        sa.Column("type", sa.String(length=256), nullable=False),
        sa.Column("entry_day", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("has_model", sa.Boolean(), nullable=False),
        sa.Column("assistant", sa.Boolean(), nullable=False),
        sa.Column("inherited", sa.Boolean(), nullable=False),
        sa.Column("events", sa.BigInteger(), nullable=False),
        sa.Column("payload_bytes", sa.BigInteger(), nullable=False),
        sa.Column("blob_bytes", sa.BigInteger(), nullable=False),
        sa.Column("responses", sa.BigInteger(), nullable=False),
        sa.Column("input", sa.Numeric(), nullable=True),
        sa.Column("output", sa.Numeric(), nullable=True),
        sa.Column("cache_read", sa.Numeric(), nullable=True),
        sa.Column("cache_write", sa.Numeric(), nullable=True),
        sa.Column("total_tokens", sa.Numeric(), nullable=True),
        sa.Column("cost", sa.Numeric(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "uq_event_rollups_key",
        "event_rollups",
        [
            "day",
            "session_id",
            "type",
            "entry_day",
            "model",
            "has_model",
            "assistant",
            "inherited",
        ],
        unique=True,
    )
    op.create_index("ix_event_rollups_session", "event_rollups", ["session_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_event_rollups_session", table_name="event_rollups")
    op.drop_index("uq_event_rollups_key", table_name="event_rollups")
    op.drop_table("event_rollups")
    op.drop_table("event_rollup_blocks")
