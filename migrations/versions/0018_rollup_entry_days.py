"""rollup_entry_days: forget the stats rollup, whose entry days were read the old way

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-27 10:00:00

stats()'s usage by day took an entry's day from the first ten characters of any text
`timestamp` ("yesterday" was a day, "2025-02-30T..." was too) and ignored epoch-millisecond
numbers. It now takes it from the entry time's one definition (core.query.entry_time), so
rows rolled up under the old reading would disagree with the live events. The markers and
the figures are deleted together (no block counted with no figures, or figures with no
block); readers roll the journal up again as they need it.
"""
from collections.abc import Sequence

from alembic import op


revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("DELETE FROM event_rollup_blocks")
    op.execute("DELETE FROM event_rollups")


def downgrade() -> None:
    upgrade()  # the old reading rolls them up again its own way
