"""sessions.external_id and import_offsets: idempotent, resumable imports of agent files

Revision ID: 0007
Revises: 0009
Create Date: 2026-11-23 20:30:00

An imported session keeps the id its agent gave it (the pi header's ``id``) as
``external_id``, unique per tenant, so commands accept it and a re-import finds the session.
``import_offsets`` records how much of the file was imported (bytes, lines, events) and a
hash of that prefix: the next pass appends only what follows, and refuses a changed prefix.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("external_id", sa.String(length=200), nullable=True))
        batch_op.create_unique_constraint(
            "uq_sessions_tenant_external_id", ["tenant_id", "external_id"]
        )
    op.create_table(
        "import_offsets",
        sa.Column("session_id", sa.String(length=36), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("format", sa.String(length=32), nullable=False),
        sa.Column("consumed_bytes", sa.BigInteger(), nullable=False),
        sa.Column("lines", sa.BigInteger(), nullable=False),
        sa.Column("entries", sa.BigInteger(), nullable=False),
        sa.Column("prefix_sha256", sa.String(length=64), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"]),
        sa.PrimaryKeyConstraint("session_id"),
    )


def downgrade() -> None:
    op.drop_table("import_offsets")
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.drop_constraint("uq_sessions_tenant_external_id", type_="unique")
        batch_op.drop_column("external_id")
