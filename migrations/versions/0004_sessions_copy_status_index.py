"""sessions: index the fork reconciler's scan (copy_status, created_at)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-21 16:00:00

The periodic reconciler asks for forks whose artifact copy is still pending, oldest first.
Without an index that is a scan of every session on every run.
"""
from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.create_index(
            "ix_sessions_copy_status_created", ["copy_status", "created_at"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.drop_index("ix_sessions_copy_status_created")
