"""rehydrations: one build of a session's rehydrated export per (session, format, head)

Revision ID: 0012
Revises: 0007
Create Date: 2026-11-23 20:50:00

Identical requests for a session's rehydrated content collapse into one build while it
runs, and reuse its output (an expiring artifact) until it expires.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "rehydrations",
        sa.Column("session_id", sa.String(length=36), nullable=False),
        sa.Column("format", sa.String(length=16), nullable=False),
        sa.Column("head_seq", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("builder", sa.String(length=64), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("artifact_id", sa.String(length=64), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("builds", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("session_id", "format", "head_seq"),
    )


def downgrade() -> None:
    op.drop_table("rehydrations")
