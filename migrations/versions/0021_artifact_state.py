"""artifact_state: whether an artifact's bytes are whole (complete), still being written
(writing), or what a dead writer left (truncated)

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-28 10:20:00

A streamed tool output (``ArtifactManager.allocate_path``) had its row, with size 0, before
its file was written, and nothing told a reader that the file was partial: a process killed
mid-write left a row whose partial file was served, listed, copied into forks and exported
as the whole output, for ever. Rows now say so: ``allocate_path`` inserts ``writing``,
``finalize_tool_output`` sets ``complete`` with the size in one transaction, and expiry
marks a row its writer left ``writing`` too long ago ``truncated``. Every row written before
is complete (``save``/``put`` wrote whole files, and a streamed output cannot be told apart
from its size any more). ``ix_artifacts_state_created`` finds the stale ones without reading
every row.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("artifacts") as batch_op:
        batch_op.add_column(
            sa.Column("state", sa.String(length=16), nullable=False, server_default="complete")
        )
        batch_op.create_index("ix_artifacts_state_created", ["state", "created_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("artifacts") as batch_op:
        batch_op.drop_index("ix_artifacts_state_created")
        batch_op.drop_column("state")
