"""Export a session as a version-3 pi file: the header first, then every entry as stored,
with its original ``id``/``parentId`` and its blobs rehydrated to the exact original values.

An imported session keeps its file's (migrated) header as the event at seq 1, so a v3 file
comes back value for value. A session made here gets a header built from its row.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import IO, TYPE_CHECKING, Any

from core.interop import pi
from core.records import Session, StoredEvent

if TYPE_CHECKING:
    from core.store import SessionStore

_PAGE = 1000


def export_pi(
    store: SessionStore,
    session_ref: str,
    out: IO[str],
    *,
    at_seq: int | None = None,
    tenant_id: str | None = None,
) -> int:
    """Write the session (up to ``at_seq``) to ``out``; returns the number of lines."""
    session = store.resolve_session(session_ref, tenant_id=tenant_id)
    header, entries = session_lines(store, session, at_seq=at_seq)
    return pi.write(out, header, entries)


def session_lines(
    store: SessionStore, session: Session, *, at_seq: int | None = None
) -> tuple[dict[str, Any], Iterator[dict[str, Any]]]:
    """The header and the entries (rehydrated, lazily read) of a version-3 file."""
    events = _events(store, session, at_seq)
    first = next(events, None)
    if first is not None and first.type == pi.HEADER_TYPE:
        header = first.payload
        entries: Iterator[dict[str, Any]] = (e.payload for e in events)
    else:
        header = pi.new_header(
            session.external_id or session.id,
            timestamp=js_iso(session.created_at),
            cwd=session.cwd,
        )
        rest = (e.payload for e in events)
        entries = rest if first is None else _chain(first.payload, rest)
    return header, (e for e in entries if e.get("type") != pi.HEADER_TYPE)


def _chain(first: dict[str, Any], rest: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield first
    yield from rest


def _events(store: SessionStore, session: Session, at_seq: int | None) -> Iterator[StoredEvent]:
    after = 0
    while True:
        page = store.read(session.id, after_seq=after, upto_seq=at_seq, limit=_PAGE, rehydrate=True)
        if not page:
            return
        yield from page
        after = page[-1].seq


def js_iso(stamp: datetime) -> str:
    """``Date.prototype.toISOString``: milliseconds and a ``Z``."""
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"
