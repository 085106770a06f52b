"""import_offsets.source_version and id_map: continuing an older pi file pi rewrote

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27 07:00:00

pi migrates a version-1 or -2 file in place when it opens it (rewriting every line with
JSON.stringify; a version-1 file's entries get new random ids), and the journal holds what
the import derived. ``source_version`` is the lowest header version the session's file had
(null: imported before this revision), so a later pass knows pi may have rewritten it;
``id_map`` maps the rewritten file's ids to the stored ones (JSON: file id -> stored id), so
the entries pi appends hang on the stored tree. Null: the file's ids are the stored ones.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("import_offsets", schema=None) as batch_op:
        batch_op.add_column(sa.Column("source_version", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("id_map", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("import_offsets", schema=None) as batch_op:
        batch_op.drop_column("id_map")
        batch_op.drop_column("source_version")
