"""maintenance_runs: one row per execution of a periodic maintenance job

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 09:00:00

Every beat-driven job (blob GC, artifact expiry) records when it started and finished,
whether it ran or skipped (another process held the period's slot, or the previous run was
still going), and its report as JSON. Ops read it to see what maintenance did; the beat
tests count executions per period from it.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "maintenance_runs",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("job", sa.String(length=64), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ran", sa.Boolean(), nullable=False),
        sa.Column(
            "report",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("maintenance_runs", schema=None) as batch_op:
        batch_op.create_index("ix_maintenance_runs_job_started", ["job", "started_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("maintenance_runs", schema=None) as batch_op:
        batch_op.drop_index("ix_maintenance_runs_job_started")
    op.drop_table("maintenance_runs")
