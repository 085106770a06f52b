"""Session state at any seq: the latest usable snapshot, plus a fold of the events after it.

Snapshots are written lazily, by reads, not by appends:

- a snapshot at seq ``s`` is a pure function of the session's first ``s`` events and the
  projection version, and events are immutable, so any reader may write it and concurrent
  readers write identical bytes (insert-if-absent);
- the append path stays what invariants 3-5 need it to be: one short transaction under the
  writers' lock, with no projection work and no dependency on the projection version;
- only sessions that are actually read pay for snapshots, and a new projection version
  rebuilds them on demand instead of in a migration.

Snapshots sit at multiples of ``settings.snapshot_every``. A read that folds past such a
boundary stores the fold as it was there (only the last boundary passed, so a long rebuild
writes one snapshot, not one per boundary). ``snapshot_every=0`` neither reads nor writes
them; the result is the same, which the test suite checks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Engine, delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import SQLAlchemyError

from core.blobs.rehydrate import StateLoader
from core.db import is_sqlite, read_connection, write_transaction
from core.errors import SnapshotFormatError
from core.journal.journal import Journal
from core.journal.validation import check_at_seq, check_seq
from core.models import ArtifactRow, SnapshotRow, table_of, utcnow
from core.query.fold_codec import decode_fold, encode_fold
from core.query.projection import FOLD_POINTERS, PROJECTION_VERSION, Fold, apply
from core.query.state import (
    NO_STRINGS,
    ArtifactEntry,
    FoldStrings,
    SessionState,
    build_state,
    fold_refs,
    plan_context,
)
from core.records import StoredEvent

log = logging.getLogger(__name__)

_snapshots = table_of(SnapshotRow)
_artifacts = table_of(ArtifactRow)

# Context entries a few seqs apart are read with one range query rather than many.
_MAX_GAP = 64
# Events a state read keeps from its fold for the context instead of reading them again.
KEEP_FOLDED = 5000


def session_state(
    journal: Journal,
    session_id: str,
    *,
    at_seq: int | None = None,
    tenant_id: str | None = None,
    snapshot_every: int = 0,
    rehydrate: StateLoader | None = None,
) -> SessionState:
    """The state of a session after ``at_seq``: from 0 to its head (the default), as an
    export or a fork takes it (``InvalidArgument`` past the head).

    ``rehydrate`` is applied to the events whose content the state shows, and to the refs
    the fold kept among the strings the state takes from it (``fold_refs``), and to nothing
    else: it is where blob refs become (lazy) values, or the strings they stand for.
    """
    if at_seq is not None:
        check_seq(at_seq, "at_seq")  # a bad type or a negative: before any read
    session = journal.get_session(session_id, tenant_id=tenant_id)
    target = check_at_seq(at_seq, session.head_seq)
    folded: dict[int, StoredEvent] = {}
    fold = fold_at(journal, session_id, target, snapshot_every=snapshot_every, keep=folded)
    plan = plan_context(fold)
    # The context is mostly the latest events, which the fold has just read and decoded:
    # reuse them, and read only the seqs it did not keep (before a snapshot, or long ago).
    wanted = plan.seqs(fold.tree)
    events = read_seqs(journal, session_id, [s for s in wanted if s not in folded])
    events += [folded[s] for s in wanted if s in folded]
    strings = NO_STRINGS
    if rehydrate is not None:
        events = rehydrate.events(events)
        refs = fold_refs(fold, plan)
        if refs:
            found = rehydrate.strings(session_id, refs, pointers=FOLD_POINTERS, upto_seq=target)
            strings = FoldStrings(found)
    return build_state(
        fold,
        plan,
        {event.seq: event for event in events},
        session=session,
        artifacts=artifact_index(journal.engine, session_id, target),
        strings=strings,
    )


def fold_at(
    journal: Journal,
    session_id: str,
    seq: int,
    *,
    snapshot_every: int,
    keep: dict[int, StoredEvent] | None = None,
) -> Fold:
    """The fold after ``seq``: from the latest usable snapshot at or before it, if any.

    ``keep`` receives the last ``KEEP_FOLDED`` events folded, by seq (payloads are final
    and shared, never modified).
    """
    found, rejected = (
        load_snapshot(journal.engine, session_id, seq) if snapshot_every else (None, [])
    )
    fold = found if found is not None else Fold()
    boundary = seq - seq % snapshot_every if snapshot_every else 0
    # The last boundary passed, and each unusable snapshot found on the way, which this
    # fold passes too: one written by the fold replaces it (insert-if-absent would keep it).
    wanted = {boundary, *rejected}
    pending: dict[int, bytes] = {}
    for event in journal.iter_events(session_id, after_seq=fold.seq, upto_seq=seq):
        apply(fold, event)
        if keep is not None:
            keep[event.seq] = event
            if len(keep) > KEEP_FOLDED:
                del keep[next(iter(keep))]  # the oldest: dicts keep insertion order
        if event.seq in wanted:
            pending[event.seq] = encode_fold(fold)
    for at, state in pending.items():
        save_snapshot(journal.engine, session_id, at, state, replace=at in rejected)
    return fold


def read_seqs(journal: Journal, session_id: str, seqs: Sequence[int]) -> list[StoredEvent]:
    """The events at these (ascending) seqs, read as a few contiguous ranges."""
    wanted = set(seqs)
    found: list[StoredEvent] = []
    start = 0
    while start < len(seqs):
        end = start
        while end + 1 < len(seqs) and seqs[end + 1] - seqs[end] <= _MAX_GAP:
            end += 1
        found.extend(
            event
            for event in journal.iter_events(
                session_id, after_seq=seqs[start] - 1, upto_seq=seqs[end]
            )
            if event.seq in wanted
        )
        start = end + 1
    return found


# the snapshots table ------------------------------------------------------------------


_PG_LATEST = (
    "SELECT seq, state FROM snapshots WHERE session_id = %s AND version = %s AND seq <= %s "
    "ORDER BY seq DESC LIMIT 1"
)


def _latest_row(engine: Engine, session_id: str, at_seq: int) -> tuple[int, bytes] | None:
    if not is_sqlite(engine):
        # bytea travels as hex text by default: twice the bytes plus a decode; the binary
        # protocol hands the snapshot over as stored (this is most of a head read's cost).
        with engine.connect() as conn:
            driver: Any = conn.connection.driver_connection
            with driver.cursor(binary=True) as cursor:
                cursor.execute(_PG_LATEST, (session_id, PROJECTION_VERSION, at_seq))
                found = cursor.fetchone()
        return None if found is None else (int(found[0]), bytes(found[1]))
    query = (
        select(_snapshots.c.seq, _snapshots.c.state)
        .where(
            _snapshots.c.session_id == session_id,
            _snapshots.c.version == PROJECTION_VERSION,
            _snapshots.c.seq <= at_seq,
        )
        .order_by(_snapshots.c.seq.desc())
        .limit(1)
    )
    with read_connection(engine) as conn:
        row = conn.execute(query).first()
    return None if row is None else (int(row.seq), bytes(row.state))


def load_snapshot(engine: Engine, session_id: str, at_seq: int) -> tuple[Fold | None, list[int]]:
    """The latest usable snapshot of the current projection version at or before ``at_seq``
    (None: none), and the seqs of the unusable ones found after it, each logged once here.

    Only an optimisation is lost with an unusable snapshot: the fold starts from the one
    before it, or from the start, and the caller replaces it on the way.
    """
    rejected: list[int] = []
    below = at_seq
    while (row := _latest_row(engine, session_id, below)) is not None:
        seq, state = row
        fold = _usable(session_id, seq, state)
        if fold is not None:
            return fold, rejected
        rejected.append(seq)
        below = seq - 1
    return None, rejected


def _usable(session_id: str, seq: int, state: bytes) -> Fold | None:
    extra = {"session_id": session_id, "seq": seq, "version": PROJECTION_VERSION}
    try:
        fold = decode_fold(state)
    except SnapshotFormatError as exc:
        log.warning("ignoring an unreadable snapshot (this read replaces it): %s", exc, extra=extra)
        return None
    if fold.seq != seq:
        log.warning(
            "ignoring a snapshot whose content is for another seq (this read replaces it)",
            extra={**extra, "content_seq": fold.seq},
        )
        return None
    return fold


def save_snapshot(
    engine: Engine, session_id: str, seq: int, state: bytes, *, replace: bool = False
) -> bool:
    """Store a snapshot unless one exists already (``replace``: over an unusable one);
    False if it could not be stored.

    Replacing is safe without comparing: every good snapshot of a seq is the same bytes.
    """
    insert_ = sqlite_insert if is_sqlite(engine) else pg_insert
    stmt = insert_(_snapshots).values(
        session_id=session_id,
        version=PROJECTION_VERSION,
        seq=seq,
        state=state,
        created_at=utcnow(),
    )
    if replace:
        stmt = stmt.on_conflict_do_update(
            index_elements=[_snapshots.c.session_id, _snapshots.c.version, _snapshots.c.seq],
            set_={"state": stmt.excluded.state, "created_at": stmt.excluded.created_at},
        )
    else:
        stmt = stmt.on_conflict_do_nothing()
    try:
        with write_transaction(engine) as conn:
            conn.execute(stmt)
    except SQLAlchemyError as exc:
        # e.g. the session was deleted meanwhile, or a read-only replica: the read still works
        log.warning(
            "could not store a snapshot: %s",
            exc,
            extra={"session_id": session_id, "seq": seq, "version": PROJECTION_VERSION},
        )
        return False
    log.debug(
        "snapshot replaced" if replace else "snapshot stored",
        extra={"session_id": session_id, "seq": seq, "bytes": len(state)},
    )
    return True


def list_snapshots(engine: Engine, session_id: str) -> list[tuple[int, int, int]]:
    """(version, seq, size in bytes) of a session's snapshots, oldest first."""
    query = (
        select(_snapshots.c.version, _snapshots.c.seq, func.length(_snapshots.c.state))
        .where(_snapshots.c.session_id == session_id)
        .order_by(_snapshots.c.version, _snapshots.c.seq)
    )
    with read_connection(engine) as conn:
        return [(int(v), int(s), int(n)) for v, s, n in conn.execute(query)]


def delete_snapshots(conn: Connection, session_id: str) -> None:
    """Remove a session's snapshots (with the session itself, inside its transaction)."""
    conn.execute(delete(_snapshots).where(_snapshots.c.session_id == session_id))


# the artifacts index --------------------------------------------------------------------


def artifact_index(engine: Engine, session_id: str, at_seq: int) -> list[ArtifactEntry]:
    """The session's artifacts created at or before ``at_seq`` (rows as they are now)."""
    query = (
        select(
            _artifacts.c.kind,
            _artifacts.c.local_id,
            _artifacts.c.name,
            _artifacts.c.tool_type,
            _artifacts.c.size_bytes,
            _artifacts.c.media_type,
            _artifacts.c.created_seq,
            _artifacts.c.expires_at,
            _artifacts.c.state,
        )
        .where(_artifacts.c.session_id == session_id, _artifacts.c.created_seq <= at_seq)
        .order_by(_artifacts.c.created_seq, _artifacts.c.id)
    )
    with read_connection(engine) as conn:
        return [ArtifactEntry(*row) for row in conn.execute(query)]
