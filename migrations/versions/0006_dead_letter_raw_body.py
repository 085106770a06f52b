"""dead_letters: keep undecodable messages byte for byte (raw body, content type, encoding)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 20:30:00

A message that fails before the task runs (a body that cannot be decoded, a wrong
arity, unknown fields) is dead-lettered by the worker's consumer hook with its original
bytes and what the broker said they were, so nothing is acked without a trace.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("dead_letters", schema=None) as batch_op:
        batch_op.add_column(sa.Column("raw_body", sa.LargeBinary(), nullable=True))
        batch_op.add_column(sa.Column("content_type", sa.String(length=128), nullable=True))
        batch_op.add_column(sa.Column("content_encoding", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("dead_letters", schema=None) as batch_op:
        batch_op.drop_column("content_encoding")
        batch_op.drop_column("content_type")
        batch_op.drop_column("raw_body")
