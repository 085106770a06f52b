"""artifact_sidecar_sha256: the SHA-256 of an agent output's JSONL sidecar

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-30 09:00:00

An agent output's row recorded the digest of its markdown only, so its JSONL sidecar,
damaged on disk or on S3, was served by the oh-my-pi export unchecked. Rows now carry the
sidecar's SHA-256 as well, set where it is written, and the export checks it. Rows written
before, and outputs without a sidecar, have none (NULL): such a sidecar is not checked.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("artifacts") as batch_op:
        batch_op.add_column(sa.Column("sidecar_sha256", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("artifacts") as batch_op:
        batch_op.drop_column("sidecar_sha256")
