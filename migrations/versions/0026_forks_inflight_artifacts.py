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
whatever the fork's copy had taken) included. First, the rows of those forks identical to
their parent's are marked inherited: 0025 judged them by two hosts' clocks, and a writer
ahead of the forking host left them unmarked, which the reads and the copy, now going by
the marks alone, would take for the fork's own (its inherited file neither served nor
copied). The downgrade keeps them: the older code reads them as rows the fork wrote
itself.
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


# every field of a row but its session's: a fork's row identical to its parent's
_IDENTITY = (
    "name",
    "tool_type",
    "size_bytes",
    "media_type",
    "created_at",
    "created_seq",
    "expires_at",
    "summary",
    "state",
    "sha256",
    "sidecar_sha256",
)


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    true, false = ("true", "false") if postgres else ("1", "0")
    same = "IS NOT DISTINCT FROM" if postgres else "IS"  # NULL-safe equality
    identical = " AND ".join(f"p.{c} {same} artifacts.{c}" for c in _IDENTITY)
    # Marks 0025 missed: it judged by two hosts' clocks (a row's ``created_at``, by its
    # writer's, against the fork's, by the forking host's), and a writer ahead left a row
    # the fork did inherit unmarked. Until now the read path and the copy still found it by
    # the parent's identical row; they now go by the marks alone. A row of an unfinished
    # fork, at or before its fork point, identical to its parent's is inherited.
    op.execute(
        f"UPDATE artifacts SET inherited = {true} WHERE inherited = {false} AND EXISTS ("
        "SELECT 1 FROM sessions s JOIN artifacts p ON p.session_id = s.parent_id"
        " AND p.kind = artifacts.kind AND p.local_id = artifacts.local_id"
        " WHERE s.id = artifacts.session_id AND s.copy_status IN ('pending', 'failed')"
        f" AND artifacts.created_seq <= s.forked_from_seq AND {identical})"
    )
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
