"""import_offsets.parent_path and parent_external: a pi fork's parent, until it is imported

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-27 07:10:00

A pi file whose header names its parent (``parentSession``, the parent file's path) is
linked to the parent's session once both are imported. The link was made only on the
child's own pass, so a child imported before its parent stayed unlinked until its next
pass. The child's reference is now kept (the path resolved, and the session id its file
name ends with), and the parent's pass links the children waiting for it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("import_offsets", schema=None) as batch_op:
        batch_op.add_column(sa.Column("parent_path", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("parent_external", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("import_offsets", schema=None) as batch_op:
        batch_op.drop_column("parent_external")
        batch_op.drop_column("parent_path")
