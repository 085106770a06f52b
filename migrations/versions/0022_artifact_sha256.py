"""artifact_sha256: the SHA-256 of an artifact's bytes, recorded when they are written

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-29 09:00:00

An artifact's file (or S3 object) overwritten in place, or cut short, was served as the
artifact: nothing compared what was read with what was written. Rows now carry the SHA-256
of the bytes a reader is served, set where those bytes are written (with ``size_bytes``),
and readers check both. Rows written before have none (NULL): their size is still checked.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("artifacts") as batch_op:
        batch_op.add_column(sa.Column("sha256", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("artifacts") as batch_op:
        batch_op.drop_column("sha256")
