"""writes: index a session's writes by first_seq (session_id, first_seq)

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-29 10:00:00

An import resuming a file asks for the session's latest import batch begun before a file
event (Journal.latest_numbered_write: ORDER BY first_seq DESC LIMIT 1). Without an index
that read and sorted every write of the session on every resume; with it, it is the first
rows of a backward index scan.
"""
from collections.abc import Sequence

from alembic import op

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("writes", schema=None) as batch_op:
        batch_op.create_index(
            "ix_writes_session_first_seq", ["session_id", "first_seq"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("writes", schema=None) as batch_op:
        batch_op.drop_index("ix_writes_session_first_seq")
