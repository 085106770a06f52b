"""import_offsets: what a later import pass needs to continue a file (five nullable columns)

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27 07:00:00

- ``source_version``, ``id_map``: pi migrates a version-1 or -2 file in place when it opens
  it (rewriting every line with JSON.stringify; a version-1 file's entries get new random
  ids), and the journal holds what the import derived. ``source_version`` is the lowest
  header version the file had, so a later pass knows pi may have rewritten it; ``id_map``
  maps the rewritten file's ids to the stored ones (JSON: file id -> stored id), so the
  entries pi appends hang on the stored tree. Null: the file's ids are the stored ones.
- ``parent_path``, ``parent_external``: a pi file whose header names its parent
  (``parentSession``) is linked once both are imported, whichever comes first: the child's
  reference is kept (the path resolved, and the session id its file name ends with), and
  the parent's pass links the children waiting for it.
- ``missing_blobs``: the oh-my-pi refs a session was imported without (JSON list). The
  journal is append-only, so a later pass that finds a blob cannot put it into the imported
  entry; every pass reports them all.

Null in each: not recorded (imported before this revision).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = (
    ("source_version", sa.Integer()),
    ("id_map", sa.Text()),
    ("parent_path", sa.Text()),
    ("parent_external", sa.Text()),
    ("missing_blobs", sa.Text()),
)


def upgrade() -> None:
    with op.batch_alter_table("import_offsets", schema=None) as batch_op:
        for name, kind in _COLUMNS:
            batch_op.add_column(sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("import_offsets", schema=None) as batch_op:
        for name, _kind in reversed(_COLUMNS):
            batch_op.drop_column(name)
