"""import_offsets.missing_blobs: the blob refs a session was imported without

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-27 07:20:00

An oh-my-pi ref whose blob was not found is imported as a kept ref (``missingBlobRef``),
and the journal is append-only: a later pass that finds the blob cannot put it into the
imported entry. Each pass reported only the refs missing from the blob directory it was
given, so a pass with the right directory listed fewer than the session lacked. The refs
the session holds without their blobs (JSON list) are now kept, and every pass reports them.
Null: not recorded (imported before this revision).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("import_offsets", schema=None) as batch_op:
        batch_op.add_column(sa.Column("missing_blobs", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("import_offsets", schema=None) as batch_op:
        batch_op.drop_column("missing_blobs")
