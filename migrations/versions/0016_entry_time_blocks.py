"""entry_time_blocks: forget the time-block summary's entry-time bounds of the old reading

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-27 07:00:00

An entry time (the payload's own `timestamp`) now has one definition on both backends
(core.query.entry_time). Some texts count that did not on one backend (offsets such as
+0530 on SQLite, +16:00 on PostgreSQL), so a block summarized under the old reading may
bound its entry times too low, and `events --since` would start past a match. The rows are
deleted; readers fill the summary again as they need it (one read of the journal).
"""
from collections.abc import Sequence

from alembic import op


revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("DELETE FROM event_time_blocks")


def downgrade() -> None:
    op.execute("DELETE FROM event_time_blocks")  # the old reading refills them its own way
