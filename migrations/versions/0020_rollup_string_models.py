"""rollup_string_models: forget the stats rollup, whose models were read from any JSON value

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-28 00:40:00

stats() named an assistant message's model from any JSON value at ``message.model``: a
number or a boolean became a model (``1e+16`` on PostgreSQL, ``1.0e+16`` on SQLite). It now
takes strings only, as the fold does (core.query.analytics._json_text), so rows rolled up
under the old reading would disagree with the days read live. The markers and the figures
are deleted together; readers roll the journal up again as they need it.
"""
from collections.abc import Sequence

from alembic import op


revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("DELETE FROM event_rollup_blocks")
    op.execute("DELETE FROM event_rollups")


def downgrade() -> None:
    upgrade()  # the old reading rolls them up again its own way
