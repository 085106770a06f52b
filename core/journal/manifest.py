"""Reading the manifest (``blob_refs``): which blob each externalized value of an event is."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

from sqlalchemy import Engine, bindparam, select

from core.db import read_connection
from core.models import BlobRefRow, EventRow, table_of
from core.records import ManifestEntry, StoredEvent

_refs = table_of(BlobRefRow)
_events = table_of(EventRow)

_MANIFEST = select(
    _refs.c.position, _refs.c.pointer, _refs.c.hash, _refs.c.size, _refs.c.encoding
).order_by(_refs.c.position, _refs.c.id)
_OF_SESSION = _MANIFEST.where(
    _refs.c.session_id == bindparam("sid"),
    _refs.c.position >= bindparam("low"),
    _refs.c.position <= bindparam("high"),
)


def of_positions(engine: Engine, positions: Sequence[int]) -> dict[int, list[ManifestEntry]]:
    """Manifest rows of these event positions, keyed by position."""
    found: dict[int, list[ManifestEntry]] = {}
    with read_connection(engine) as conn:
        for chunk_start in range(0, len(positions), 900):
            chunk = list(positions[chunk_start : chunk_start + 900])
            _collect(found, conn.execute(_MANIFEST.where(_refs.c.position.in_(chunk))))
    return found


def of_events(engine: Engine, events: Sequence[StoredEvent]) -> dict[int, list[ManifestEntry]]:
    """Manifest rows of these events, keyed by position: one query per session.

    Each session's rows come from the ``blob_refs.session_id`` index, bounded by the
    positions read: no IN list of every position (a bind parameter each), and no query per
    blob or per page. Rows of positions not asked for are dropped here.
    """
    bounds: dict[str, tuple[int, int]] = {}
    for event in events:
        low, high = bounds.get(event.session_id, (event.position, event.position))
        bounds[event.session_id] = (min(low, event.position), max(high, event.position))
    wanted = {event.position for event in events}
    found: dict[int, list[ManifestEntry]] = {}
    if not bounds:
        return found
    with read_connection(engine) as conn:
        for session_id, (low, high) in bounds.items():
            rows = conn.execute(_OF_SESSION, {"sid": session_id, "low": low, "high": high})
            _collect(found, (r for r in rows if r.position in wanted))
    return found


def places_of_hashes(
    engine: Engine,
    session_id: str,
    hashes: Collection[str],
    *,
    pointers: Collection[str],
    upto_seq: int,
) -> list[tuple[int, ManifestEntry]]:
    """(seq, row) of the session's manifest rows up to ``upto_seq`` that place one of these
    blobs at one of these pointers."""
    query = (
        select(_events.c.seq, _refs.c.pointer, _refs.c.hash, _refs.c.size, _refs.c.encoding)
        .join(_events, _events.c.position == _refs.c.position)
        .where(
            _refs.c.session_id == session_id,
            _refs.c.pointer.in_(sorted(pointers)),
            _events.c.seq <= upto_seq,
        )
        .order_by(_refs.c.position, _refs.c.id)
    )
    ordered = sorted(hashes)
    found: list[tuple[int, ManifestEntry]] = []
    with read_connection(engine) as conn:
        for start in range(0, len(ordered), 900):
            rows = conn.execute(query.where(_refs.c.hash.in_(ordered[start : start + 900])))
            found += [(r.seq, ManifestEntry(r.pointer, r.hash, r.size, r.encoding)) for r in rows]
    return found


def hashes_of_session(engine: Engine, session_id: str) -> set[str]:
    """Every blob the session's manifest references (from the ``session_id`` index)."""
    query = select(_refs.c.hash).where(_refs.c.session_id == session_id).distinct()
    with read_connection(engine) as conn:
        return set(conn.execute(query).scalars())


def _collect(found: dict[int, list[ManifestEntry]], rows: Iterable[Any]) -> None:
    for r in rows:
        found.setdefault(r.position, []).append(
            ManifestEntry(r.pointer, r.hash, r.size, r.encoding)
        )
