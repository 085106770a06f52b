"""session_removals: a deleted session's artifact directory until it is known to be removed

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27 04:45:00

A delete removed the session's directory after its commit; a crash in between, a failing
disk or S3 away left the directory for good, named by no row. The delete now records it in
its transaction and forgets it once removed; the expiry run removes what is left.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "session_removals",
        sa.Column("session_id", sa.String(length=36), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("parent_id", sa.String(length=36), nullable=True),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("session_id", "kind"),
    )


def downgrade() -> None:
    # Each row is a deleted session's directory not removed yet; the code before 0015 knows
    # no such list, so dropping rows would leave those directories for good, named by
    # nothing. Refused until the expiry run has removed them (or the rows are deleted by
    # hand, or the downgrade is forced, to leave the directories behind knowingly).
    from core.migrate import refuse_downgrade

    refuse_downgrade(
        "0015",
        "SELECT count(*) FROM session_removals",
        lambda pending: f"{pending} deleted session(s) still have artifact directories to "
        "remove: run `sessionstore expire --apply` until none is left (or downgrade with "
        "--force, `alembic -x force=1`, to leave those directories behind), then downgrade",
    )
    op.drop_table("session_removals")
