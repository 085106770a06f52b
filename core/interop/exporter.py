"""Export a session as a version-3 pi file: the header first, then every entry as stored,
with its original ``id``/``parentId`` and its blobs rehydrated to the exact original values.

An imported session keeps its file's (migrated) header as the event at seq 1, so a v3 file
comes back value for value. A session made here gets a header built from its row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import IO, TYPE_CHECKING, Any

from core.blobs.rehydrate import Rehydrator, holds_ref
from core.errors import ExportIncomplete
from core.interop import pi
from core.journal.validation import check_at_seq
from core.records import ManifestEntry, Session, StoredEvent

if TYPE_CHECKING:
    from core.store import SessionStore

_PAGE = 200


def export_pi(
    store: SessionStore,
    session_ref: str,
    out: IO[str],
    *,
    at_seq: int | None = None,
    tenant_id: str | None = None,
) -> int:
    """Write the session (up to ``at_seq``) to ``out``; returns the number of lines.
    ``ExportIncomplete`` once it is written if a blob could not be read (its ref stands in
    the file in place of the value: never passed off as the session's data)."""
    session = store.resolve_session(session_ref, tenant_id=tenant_id)
    at_seq = check_at_seq(at_seq, session.head_seq)
    missing: list[str] = []
    events = rehydrated_events(store, session, at_seq, missing)
    lines = write_pi(session, events, out, parent_file=parent_file(store, session))
    if missing:
        raise ExportIncomplete(missing, lines)
    return lines


def write_pi(
    session: Session,
    events: Iterator[StoredEvent],
    out: IO[str],
    *,
    parent_file: str | None = None,
) -> int:
    """The pi v3 file of ``events`` (the session's, in seq order, rehydrated)."""
    header, entries = pi_lines(session, events, parent_file=parent_file)
    return pi.write(out, header, entries)


def parent_file(store: SessionStore, session: Session) -> str | None:
    """The file a fork's parent was imported from (pi's ``parentSession`` names the parent
    by its file); None for a session that is no fork, or whose parent came from no file."""
    if session.forked_from_seq is None or session.parent_id is None:
        return None
    from core.interop.importer import imported_path

    return imported_path(store, session.parent_id)


def session_lines(
    store: SessionStore,
    session: Session,
    *,
    at_seq: int | None = None,
    missing: list[str] | None = None,
) -> tuple[dict[str, Any], Iterator[dict[str, Any]]]:
    """The header and the entries (rehydrated, lazily read) of a version-3 file; the
    hashes of blobs that could not be read are added to ``missing`` as they are met."""
    at_seq = check_at_seq(at_seq, session.head_seq)
    events = rehydrated_events(store, session, at_seq, missing)
    return pi_lines(session, events, parent_file=parent_file(store, session))


def pi_lines(
    session: Session, events: Iterator[StoredEvent], *, parent_file: str | None = None
) -> tuple[dict[str, Any], Iterator[dict[str, Any]]]:
    """The header and entries of a version-3 file from the session's events: an imported
    session's stored header (seq 1; the line one kept escaped for a lone surrogate keeps,
    which ``pi.write`` writes back as it was), or one built from the session row. Only
    that is the header: a later ``session`` line is an entry, written back where it was, as
    pi keeps it in its file (its ``getHeader`` is the first).

    A fork (``forked_from_seq``) names itself, as pi's own forks do: the header it inherited
    is its ancestor's, whose id would take the file for that session (an import of it
    would continue the ancestor with the fork's entries). Its ``parentSession`` is the file
    its parent was imported from (``parent_file``), when there is one."""
    first = next(events, None)
    fork = session.forked_from_seq is not None
    stored = pi.stored_header(first.type, first.payload) if first is not None else None
    if stored is not None:
        header = _fork_header(stored, session, parent_file) if fork else stored
        entries: Iterator[dict[str, Any]] = (e.payload for e in events)
    else:
        header = pi.new_header(
            session.external_id or session.id,
            timestamp=js_iso(session.created_at),
            cwd=session.cwd,
            parent_session=parent_file if fork else None,
        )
        rest = (e.payload for e in events)
        entries = rest if first is None else _chain(first.payload, rest)
        # none for an export at seq 0 of a session with events (the header alone)
        no_events = first is None and session.head_seq > 0
        named = None if no_events else _title_entry(session, header)
        if named is not None:
            entries = _chain(named, entries)
    return header, entries


def _title_entry(session: Session, header: dict[str, Any]) -> dict[str, Any] | None:
    """A session made here has its title in its row alone, which a pi header cannot hold:
    its file names it as pi's ``/name`` does, with a ``session_info`` entry (an import of the
    file takes the title from there). It comes first, a root of its own, dated as the
    header: the same at each export, and a later export extends an earlier one (an import
    of the first then continues with the second). A later ``session_info`` among the
    session's entries names it after, as pi reads them."""
    name = pi.info_name({"name": session.title})
    if not name or "\0" in name:  # nothing pi would show, or no row could hold
        return None
    return {
        "type": pi.SESSION_INFO,
        "id": f"title-{hashlib.sha256(session.id.encode()).hexdigest()[:8]}",
        "parentId": None,
        "timestamp": header["timestamp"],
        "name": name,
    }


def _fork_header(
    inherited: dict[str, Any], session: Session, parent_file: str | None
) -> dict[str, Any]:
    """The inherited header as the fork's own: its id, its start, its parent; whatever else
    the header holds is kept, in its place."""
    header = {k: v for k, v in inherited.items() if k != "parentSession"}
    header.update(id=session.external_id or session.id, timestamp=js_iso(session.created_at))
    if parent_file is not None:
        header["parentSession"] = parent_file
    return header


def _chain(first: dict[str, Any], rest: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield first
    yield from rest


def rehydrated_events(
    store: SessionStore,
    session: Session,
    upto_seq: int | None,
    missing: list[str] | None = None,
    *,
    moved: Callable[[], None] | None = None,
) -> Iterator[StoredEvent]:
    """The session's events up to ``upto_seq``, each rehydrated on its own: memory holds
    one event's blobs at a time, however large the session. A blob that could not be read
    (missing, or corrupt and refused) leaves its ref in place, and its hash in ``missing``.
    ``moved``, if given, is called after each page read and each blob value resolved."""
    for event, entries in rehydrated_with_manifest(store, session, upto_seq, moved=moved):
        if missing is not None:
            missing.extend(unresolved(event, entries))
        yield event


def unresolved(full: StoredEvent, entries: Sequence[ManifestEntry]) -> list[str]:
    """Blob hashes whose ref is still in place after rehydration (missing or corrupt)."""
    return [entry.hash for entry in entries if holds_ref(full.payload, entry)]


def rehydrated_with_manifest(
    store: SessionStore,
    session: Session,
    upto_seq: int | None,
    *,
    moved: Callable[[], None] | None = None,
) -> Iterator[tuple[StoredEvent, Sequence[ManifestEntry]]]:
    """Each rehydrated event with its manifest entries: one manifest query per page of
    events, and one event's blobs in memory at a time. ``moved``: as ``rehydrated_events``."""
    rehydrator = Rehydrator(store.blobs, on_read=moved)
    after = 0
    while True:
        page = store.journal.read(session.id, after_seq=after, upto_seq=upto_seq, limit=_PAGE)
        if not page:
            return
        manifest = store.journal.manifest_of(page)
        if moved is not None:
            moved()
        for event in page:
            entries = manifest.get(event.position, [])
            [full] = rehydrator.events([event], {event.position: entries}) if entries else [event]
            yield full, entries
        after = page[-1].seq


def js_iso(stamp: datetime) -> str:
    """``Date.prototype.toISOString``: milliseconds and a ``Z``."""
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"
