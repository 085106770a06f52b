"""A fork's rows of artifacts unfinished at the fork: its own, with nothing to copy

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-29 07:00:00

A fork inherited a tool output that was not complete in its parent (``writing``, or
``truncated`` by expiry for a silent writer) and an agent output its parent had allocated
and not written, as they were, marked inherited. Once the parent finished either, the row
no longer matched the fork's, and the fork's copy failed for good ("changed or removed in
the parent"). A fork now takes such rows as its own at its creation
(``core.sessions.forks._fork_row``): the tool output ``truncated`` at 0 bytes (the fork
holds none of it), the agent output an unwritten slot.

Existing rows: the same, for the forks whose copy is unfinished (pending or failed: the
only ones whose copy runs again; a failed one is retried by ``sessions copy-artifacts``),
an inherited ``writing`` row that expiry has settled since (``truncated`` at the size of
whatever the fork's copy had taken) included. The downgrade keeps them: the older code
reads them as rows the fork wrote itself.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0026"
down_revision: str | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_UNFINISHED_FORK = (
    "inherited = {true} AND EXISTS (SELECT 1 FROM sessions s WHERE s.id = artifacts.session_id"
    " AND s.parent_id IS NOT NULL AND s.copy_status IN ('pending', 'failed'))"
)


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    true, false = ("true", "false") if postgres else ("1", "0")
    where = _UNFINISHED_FORK.format(true=true)
    op.execute(
        f"UPDATE artifacts SET state = 'truncated', size_bytes = 0, sha256 = NULL, "
        f"inherited = {false} WHERE kind = 'tool_output' AND state <> 'complete' AND {where}"
    )
    op.execute(
        f"UPDATE artifacts SET inherited = {false} WHERE kind = 'agent_output'"
        f" AND sha256 IS NULL AND size_bytes = 0 AND {where}"
    )


def downgrade() -> None:
    pass  # data only: nothing to undo (see the docstring)
