"""Import an agent's session file into the journal: idempotent and resumable.

A file is read by a converter (one per format, registered here with an auto-detection hook)
into a ``ParsedSession``. The session's file events are then the header (as the event at
seq 1, so that an export can write it back as it was) followed by the entries in file order.
Events appended to the session directly (not from the file) may sit between them: a pass
appends the file's new entries after whatever the session holds.

What makes a pass safe to repeat, and to interrupt:

- the session is found by the header's id (``sessions.external_id``, unique per tenant);
- ``import_offsets`` keeps how many file events were imported, the bytes they came from and
  the SHA-256 of those bytes; a pass first checks that prefix and refuses a changed one with
  ``ImportConflict`` before writing anything;
- each batch is appended under an idempotency key naming its first file event, so a pass
  that died between a batch and its offset update resumes after that batch (the key's
  record says how many events it held), and two importers of one file never double it:
  appends carry ``expected_seq``, the head as it was when the pass found where to resume,
  so a batch a concurrent pass committed since fails the append, and the pass resumes
  after it; the offset only moves forward;
- every event a pass would append is checked first, as an append checks it: a bad one fails
  the pass with ``InvalidEvent`` naming its line, and nothing is written (no session either);
- a failure while writing (the database, the blob store, an artifact) raises
  ``ImportInterrupted``, which says what was appended to which session: that stays, and
  the next pass continues after it;
- a last line without its newline is an agent mid-write: it is left for the next pass.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import importlib
import importlib.util
import json
import logging
import math
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite

from core.db import read_connection, write_transaction
from core.errors import (
    ConcurrencyConflict,
    ExternalIdTaken,
    IdempotencyKeyReused,
    ImportConflict,
    ImportFormatError,
    ImportInterrupted,
    InvalidEvent,
    SessionFileNotStarted,
    SessionStoreError,
    UnreadableFile,
)
from core.exact_json import same_value
from core.fsio import key_text, path_text
from core.interop import pi
from core.interop.model import IgnoredLine, ParsedSession, SessionHeader
from core.journal.validation import CheckedEvents, checked
from core.metrics import metrics
from core.models import ImportOffsetRow, SessionRow, table_of, utcnow
from core.records import PlainRecord, Session, StoredEvent

if TYPE_CHECKING:
    from core.store import SessionStore

log = logging.getLogger(__name__)

_offsets = table_of(ImportOffsetRow)
_sessions = table_of(SessionRow)

ImportStatus = Literal["created", "appended", "unchanged"]
# (path, the file's bytes, **options): options are format-specific (oh-my-pi: ``blobs_dir``)
Parser = Callable[..., ParsedSession]
# (path, the file's bytes) -> is it mine? A sniffer reads only as far as it needs.
Sniffer = Callable[[Path, bytes], bool]
# runs after each pass's append: files that belong to the session (oh-my-pi's artifacts)
AfterImport = Callable[["SessionStore", str, ParsedSession], None]
# interop2's converters register themselves when their module is imported
_PLUGIN_MODULES = ("core.interop.omp", "core.interop.claude_code")
# the idempotency keys of an import's batches: this and the index of the batch's first event
_KEY_PREFIX = "sessionstore.import:"


# the converter registry ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Converter:
    format: str
    parse: Parser
    # auto-detection: (path, the file's bytes) -> is it mine? Lower priority is asked
    # first, so a specific format (oh-my-pi, which is pi plus artifacts) wins over plain pi.
    sniff: Sniffer
    priority: int = 50
    after_import: AfterImport | None = None
    # the options its parser takes; the others given to an import are not for this format
    options: frozenset[str] = frozenset()


_CONVERTERS: dict[str, Converter] = {}


def register_converter(
    format: str,
    parse: Parser,
    *,
    sniff: Sniffer,
    priority: int = 50,
    after_import: AfterImport | None = None,
    options: Iterable[str] = (),
) -> None:
    _CONVERTERS[format] = Converter(
        format, parse, sniff, priority, after_import, frozenset(options)
    )


def _sniff_pi(path: Path, data: bytes) -> bool:
    return pi.sniff(data)


register_converter("pi", pi.parse, sniff=_sniff_pi, priority=100)


def converters() -> dict[str, Converter]:
    for module in _PLUGIN_MODULES:
        if module not in _loaded and importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
            _loaded.add(module)
    return dict(_CONVERTERS)


_loaded: set[str] = set()


def detect_format(path: Path, data: bytes) -> str:
    """The format of a file from its bytes (all of them: a first line or the first blob ref
    can be far into the file; each sniffer reads only as far as it needs)."""
    for converter in sorted(converters().values(), key=lambda c: c.priority):
        if converter.sniff(path, data):
            return converter.format
    raise ImportFormatError(str(path), "not a session file of a known format")


def parse_file(path: Path, *, format: str = "auto") -> ParsedSession:
    return parse_file_data(path, read_file(path), format=format)


def read_file(path: Path) -> bytes:
    """A regular file's bytes; ``UnreadableFile`` for anything else. A FIFO, a device or a
    socket is never opened: reading one would block, or worse."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise UnreadableFile(str(path), f"not a regular file ({_kind(mode)})")
        # O_NONBLOCK: should the path become a FIFO after the stat, the open does not block
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise UnreadableFile(str(path), "not a regular file")
            return file.read()
    except OSError as exc:
        raise UnreadableFile(str(path), exc.strerror or str(exc)) from None


def check_started(path: Path, data: bytes) -> None:
    """``SessionFileNotStarted`` for a file that holds no line yet (``pi.not_started``: pi
    trims a file before it splits it into lines, whatever agent wrote it)."""
    empty = pi.not_started(data)
    if empty is not None:
        raise SessionFileNotStarted(str(path), empty=empty, blank=empty and bool(data))


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device"


# importing ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ImportResult(PlainRecord):
    path: str
    session_id: str
    external_id: str
    format: str
    status: ImportStatus
    appended: int  # events appended by this pass
    skipped: int  # events already imported by an earlier pass
    incomplete_tail: bool = False  # a half-written last line was left for the next pass
    # blob refs the session holds without their blobs (kept as refs): those it was imported
    # without before and those this pass imported without
    missing_blobs: list[str] = field(default_factory=list)
    # of those, the ones this pass found: the journal is append-only, so the imported
    # entries keep the ref; delete the session and import the file again to have them
    found_late_blobs: list[str] = field(default_factory=list)
    # lines read with U+FFFD for invalid UTF-8, as pi reads them (the stored text differs)
    invalid_utf8_lines: int = 0
    # lines of the file that hold no entry (not JSON, not an object, no string type): not
    # imported, each with its line and why
    ignored_lines: list[IgnoredLine] = field(default_factory=list)
    # of the skipped events, those no finished pass had recorded: appended by another import
    # of the file running at the same time, or by one that died before it recorded them
    taken_up: int = 0


@dataclass(frozen=True, slots=True)
class _Offset:
    consumed_bytes: int
    lines: int
    entries: int
    prefix_sha256: str
    # the lowest header version the file had (None: not recorded, imported before 0017)
    source_version: int | None = None
    # file id -> stored id, once pi rewrote an imported version-1 file with new ids
    id_map: dict[str, str] = field(default_factory=dict)
    # the blob refs the session was imported without (None: not recorded, before 0017)
    missing_blobs: list[str] | None = None
    path: str = ""  # the file imported, resolved (``_resolved``)


@dataclass(frozen=True, slots=True)
class _Imported:
    """What the session holds of the file: its first ``count`` events."""

    count: int
    source_version: int | None
    id_map: dict[str, str]
    # of ``count``: events another file of the session (an export) holds that the session
    # had from elsewhere (appended directly), in the file's order
    had: int = 0


def import_session(
    store: SessionStore,
    path: str | Path,
    *,
    tenant_id: str,
    format: str = "auto",
    options: Mapping[str, Any] | None = None,
    wait_for_header: bool = False,
) -> ImportResult:
    """Import (or continue importing) one session file; see the module docstring.
    ``options`` go to the format's parser (oh-my-pi: ``blobs_dir``). ``wait_for_header``:
    a new session whose file has no line yet that gives its header a time and a working
    directory (``ParsedSession.header_pending``) is not made: ``SessionFileNotStarted``
    (a follower, which imports the file again when that line comes: the header, the
    session's first event, is never rewritten)."""
    for attempt in range(_CREATE_ATTEMPTS):
        try:
            return _import_pass(store, Path(path), tenant_id, format, options, wait_for_header)
        except ExternalIdTaken:
            # another import of this file created the session after this pass looked: the
            # next pass finds it and continues it (its batches are replayed, not doubled)
            if attempt == _CREATE_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


# a session made by a concurrent import, then deleted before this pass found it, is rare
_CREATE_ATTEMPTS = 3

# how long after its last write a new file whose lines give no header yet is waited on
HEADER_WAIT_NS = 60 * 1_000_000_000


def written_lately(mtime_ns: int) -> bool:
    """Whether a file last written at ``mtime_ns`` may still be getting its first lines
    (within ``HEADER_WAIT_NS``; a time to come, a clock ahead, is no reason to wait)."""
    return 0 <= time.time_ns() - mtime_ns < HEADER_WAIT_NS


def _import_pass(
    store: SessionStore,
    path: Path,
    tenant_id: str,
    format: str,
    options: Mapping[str, Any] | None,
    wait_for_header: bool = False,
) -> ImportResult:
    data = read_file(path)
    parsed = parse_file_data(path, data, format=format, options=options)
    _check_session_fields(path, parsed)
    session = store.journal.find_external(tenant_id, parsed.header.external_id)
    if session is None:
        parsed, session = _imported_under_former_id(store, tenant_id, path, parsed)
    if session is None and wait_for_header and parsed.header_pending:
        raise SessionFileNotStarted(str(path), empty=False, header_pending=True)
    events = [pi.header_event(parsed.header), *(e.entry for e in parsed.entries)]
    lines = [1, *(e.line for e in parsed.entries)]
    external_id = parsed.header.external_id
    # the head before the offset and the batches are read: see ``_append``
    head = session.head_seq if session else 0
    offset = _offset_of(store, session.id) if session else None
    held = _Imported(0, parsed.header.version, {})
    if session is not None:
        held = _imported(store, path, parsed, data, session, offset, events, lines)
    # beyond what earlier passes recorded: events a concurrent or dead pass appended
    skipped = held.count
    imported = held.count - held.had  # by passes of the file the session follows
    taken_up = imported - min(imported, offset.entries) if offset else 0
    events = _mapped(events, held.id_map)
    pending = _validate(store, path, events[held.count :], lines[held.count :])
    created = session is None
    if session is None:
        session = _create(store, parsed, path, tenant_id)
    elif offset is None:  # adopt an empty named session (``sessions create --id``)
        created = _adopt(store, session.id, path, parsed)
    sizes = _line_sizes(data, lines)
    # the events no finished pass recorded: this pass's, and any a dead pass appended
    missing, found_late = _missing_blobs(offset, parsed, data, events[held.count - taken_up :])
    appended = 0
    try:
        for count, mine in _append(store, session, pending, sizes, held.count, head):
            appended += count if mine else 0
            skipped += 0 if mine else count
            taken_up += 0 if mine else count
        # The file the session follows stays the one it was imported from while another
        # file of it (an export, a copy) brings nothing new.
        if appended or taken_up or offset is None or offset.path == _resolved(path):
            _save_offset(store, session.id, path, parsed, len(events), data, held, missing)
        after = converters()[parsed.format].after_import
        if after is not None:  # every pass: a pass that failed here runs it again
            after(store, session.id, parsed)
        _link_parent(store, session, parsed, tenant_id)
        _link_children(store, session, path, tenant_id)
        _fill_row(store, session, parsed)
    except (SessionStoreError, OSError) as exc:
        # What was appended stays (the next pass continues after it): say so, and where.
        raise ImportInterrupted(
            str(path),
            session_id=session.id,
            external_id=external_id,
            appended=appended,
            skipped=skipped,
            cause=exc,
        ) from exc
    status: ImportStatus = (
        "created" if created else "appended" if appended or taken_up else "unchanged"
    )
    result = ImportResult(
        path=str(path),
        session_id=session.id,
        external_id=external_id,
        format=parsed.format,
        status=status,
        appended=appended,
        skipped=skipped,
        incomplete_tail=parsed.incomplete_tail,
        missing_blobs=missing,
        found_late_blobs=found_late,
        invalid_utf8_lines=parsed.invalid_utf8_lines,
        ignored_lines=list(parsed.ignored_lines),
        taken_up=taken_up,
    )
    log.info("imported a session file", extra=result.to_dict())
    observed = metrics()
    observed.import_entries.inc(appended)
    observed.import_bytes.inc(sum(sizes[held.count :]))
    return result


def _imported_under_former_id(
    store: SessionStore, tenant_id: str, path: Path, parsed: ParsedSession
) -> tuple[ParsedSession, Session | None]:
    """The session this very file was imported into under an external id an earlier version
    keyed it by (``SessionHeader.former_ids``: a Claude Code resumed session's file was keyed
    by the first session it resumes before stop 37), if there is one, and the file as that
    session holds it. It goes on there: a second session would copy its lines. Deleting
    that session and importing again keys it as the file is keyed now."""
    for former in parsed.header.former_ids:
        found = store.journal.find_external(tenant_id, former)
        held = _offset_of(store, found.id) if found is not None else None
        if found is None or held is None or held.path != _resolved(path):
            continue
        log.warning(
            "%r: a file imported before under another id (%s): importing on into that "
            "session (delete it and import again to key it by the file)",
            str(path),
            former,
            extra={"path": str(path), "session_id": found.id, "external_id": former},
        )
        raw = parsed.header.raw
        if raw.get("id") == parsed.header.external_id:  # built from the fields: as that was
            raw = {**raw, "id": former}
        header = dataclasses.replace(
            parsed.header, external_id=former, parent_id=None, parent_session=None, raw=raw
        )
        return dataclasses.replace(parsed, header=header), found
    return parsed, None


def parse_file_data(
    path: Path,
    data: bytes,
    *,
    format: str = "auto",
    options: Mapping[str, Any] | None = None,
) -> ParsedSession:
    check_started(path, data)
    if format == "auto":
        format = detect_format(path, data)
    converter = converters().get(format)
    if converter is None:
        known = ", ".join(sorted(converters()))
        raise ImportFormatError(str(path), f"unknown format {format!r} (known: {known})")
    # a run over several formats passes each one's options (oh-my-pi's blobs_dir) to all
    mine = {k: v for k, v in (options or {}).items() if k in converter.options}
    try:
        parsed = converter.parse(path, data, **mine)
    except SessionStoreError:
        raise
    except Exception as exc:
        # A converter's own failure on odd input is still this file's typed error: the
        # caller (a run over many files) reports it and goes on with the next file.
        log.exception("a converter failed", extra={"path": str(path), "format": format})
        raise ImportFormatError(
            str(path), f"the {format} reader failed on this file: {type(exc).__name__}: {exc}"
        ) from exc
    header = parsed.header
    if not pi.is_header(header.raw):  # built from the fields as read, before they are keyed
        built = pi.new_header(header.external_id, timestamp=header.timestamp, cwd=header.cwd)
        header = dataclasses.replace(header, raw=built)
    return dataclasses.replace(parsed, header=_row_text(header))


def _row_text(header: SessionHeader) -> SessionHeader:
    """The header's fields as the session row and ``import_offsets`` hold them: a lone
    surrogate (a JSON escape pi reads; no database text holds one) written as its escape, as
    ``path_text`` writes a file name's; other text as it is. The header itself (``raw``,
    the event at seq 1) keeps it exactly."""

    def text(value: str | None) -> str | None:
        return None if value is None else path_text(value)

    return dataclasses.replace(
        header,
        # ids are keys: each as one text of its own (``key_text``), never another id's
        external_id=key_text(header.external_id),
        cwd=text(header.cwd),
        title=text(header.title),
        parent_id=None if header.parent_id is None else key_text(header.parent_id),
        former_ids=tuple(map(key_text, header.former_ids)),
    )


# what a session row holds (PostgreSQL ``text`` cannot hold U+0000)
_SESSION_FIELDS = (("external_id", "id"), ("cwd", "cwd"), ("title", "title"))


def _check_session_fields(path: Path, parsed: ParsedSession) -> None:
    """Refuse, before any read or write, a session id, cwd or title the sessions table
    cannot hold on every backend (U+0000), naming the header's field."""
    header = parsed.header
    for name, shown in _SESSION_FIELDS:
        value = getattr(header, name)
        if isinstance(value, str) and "\x00" in value:
            raise ImportFormatError(
                f"/{shown}" if parsed.format in ("pi", "omp") else name,
                f"{path}: the session's {name} contains U+0000, which a session cannot hold",
            )


def _create(store: SessionStore, parsed: ParsedSession, path: Path, tenant_id: str) -> Session:
    header = parsed.header

    # The offset row is written with the session, in its transaction: a session of this
    # external id without one was not made by an import (``sessions create --id``), never
    # an import in progress, and is adopted only while empty.
    def record(conn: Connection, session_id: str) -> None:
        conn.execute(insert(_offsets).values(_new_offset(session_id, path, parsed)))

    return store.journal.create_session(
        tenant_id=tenant_id,
        title=header.title or None,  # "": named, then cleared
        cwd=header.cwd,
        external_id=header.external_id,
        with_row=record,
    )


def _adopt(store: SessionStore, session_id: str, path: Path, parsed: ParsedSession) -> bool:
    """Record that an empty named session is imported from ``path``; False if a concurrent
    import of the file adopted it first (its row stands)."""
    upsert = postgresql.insert if store.engine.dialect.name == "postgresql" else sqlite.insert
    with write_transaction(store.engine) as conn:
        done = conn.execute(
            upsert(_offsets)
            .values(_new_offset(session_id, path, parsed))
            .on_conflict_do_nothing(index_elements=[_offsets.c.session_id])
            .returning(_offsets.c.session_id)
        )
        # a row returned, not rowcount: for an INSERT it is -1 on PostgreSQL through
        # SQLAlchemy, which made every adopter (the losers of the race too) "created"
        return done.first() is not None


def _new_offset(session_id: str, path: Path, parsed: ParsedSession) -> dict[str, Any]:
    """A session's offset row: nothing imported yet."""
    return dict(
        session_id=session_id,
        path=_resolved(path),
        format=parsed.format,
        source_version=parsed.header.version,
        **_parent_refs(parsed),
        consumed_bytes=0,
        lines=0,
        entries=0,
        prefix_sha256=hashlib.sha256(b"").hexdigest(),
        updated_at=utcnow(),
    )


def imported_path(store: SessionStore, session_id: str) -> str | None:
    """The file the session was (last) imported from, resolved; None if from none."""
    offset = _offset_of(store, session_id)
    return offset.path if offset is not None and offset.path else None


def _offset_of(store: SessionStore, session_id: str) -> _Offset | None:
    with read_connection(store.engine) as conn:
        row = conn.execute(select(_offsets).where(_offsets.c.session_id == session_id)).first()
    if row is None:
        return None
    id_map = json.loads(row.id_map) if row.id_map else {}
    missing = json.loads(row.missing_blobs) if row.missing_blobs is not None else None
    return _Offset(
        row.consumed_bytes,
        row.lines,
        row.entries,
        row.prefix_sha256,
        row.source_version,
        id_map,
        missing,
        row.path,
    )


def _imported(
    store: SessionStore,
    path: Path,
    parsed: ParsedSession,
    data: bytes,
    session: Session,
    offset: _Offset | None,
    events: Sequence[dict[str, Any]],
    lines: Sequence[int],
) -> _Imported:
    """How much of the file the session holds, with the map from the file's entry ids to
    the stored ones (see ``_rewritten_by_pi``); ``ImportConflict`` (before anything is
    written) if the part of the file already imported is not what the session has."""
    version = parsed.header.version
    if offset is None:
        if session.head_seq == 0:  # an empty named session (``sessions create --id``)
            return _Imported(0, version, {})
        raise ImportConflict(
            str(path),
            1,
            f"session {session.id} has this id but was not imported from a file",
            session_id=session.id,
            external_id=session.external_id,
        )
    done = _resumed(store, session.id, offset.entries)
    source = None if offset.source_version is None else min(offset.source_version, version)
    # a file shorter than what is imported (an older copy) holds no more than its events
    held = _Imported(min(done, len(events)), source, offset.id_map)
    prefix = data[: offset.consumed_bytes]
    if (
        len(data) >= offset.consumed_bytes
        and hashlib.sha256(prefix).hexdigest() == offset.prefix_sha256
        and done <= len(events)
    ):
        return _with_held_beyond(store, path, session, offset, held, events)
    # The bytes differ (another path, an export of the session, an edit, pi's rewrite of an
    # older file): what counts is whether any imported entry's value changed.
    mapped = _mapped(events, offset.id_map)
    line = _first_differing_line(store, session, mapped, lines, done)
    if line is None:
        log.info(
            "the imported part was re-serialized with the same values",
            extra={"path": str(path), "session_id": session.id},
        )
        return _with_held_beyond(store, path, session, offset, held, events)
    rewritten = None
    if version == pi.CURRENT_VERSION and offset.source_version != pi.CURRENT_VERSION:
        limit = max(offset.lines, lines[-1]) + 1
        rewritten = _rewritten_by_pi(store, session, events, done, offset.source_version, limit)
    if rewritten is None:
        raise ImportConflict(
            str(path),
            line,
            "the already-imported part of the file changed",
            session_id=session.id,
            external_id=session.external_id,
        )
    log.info(
        "pi rewrote the imported file when it opened it (an older version): its entries are "
        "the imported ones",
        extra={"path": str(path), "session_id": session.id, "mapped_ids": len(rewritten.id_map)},
    )
    return rewritten


def _with_held_beyond(
    store: SessionStore,
    path: Path,
    session: Session,
    offset: _Offset,
    held: _Imported,
    events: Sequence[dict[str, Any]],
) -> _Imported:
    """``held``, and for another file of the session than the one it follows (an export, a
    copy), every further event of it the session holds in its order: an export holds what
    was appended to the session directly, which is the session's already."""
    if offset.path == _resolved(path):
        return held
    done = _held_in_order(store, session, _mapped(events, offset.id_map))
    return dataclasses.replace(held, count=max(done, held.count), had=max(0, done - held.count))


def _missing_blobs(
    offset: _Offset | None,
    parsed: ParsedSession,
    data: bytes,
    new_events: Sequence[dict[str, Any]],
) -> tuple[list[str], list[str]]:
    """The blob refs the session holds without their blobs once ``new_events`` (those no
    finished pass recorded) are in it: those recorded before, and those of this pass's
    misses that these events hold; and those of the recorded ones this pass found in the
    file and its blob directory. Before 0017 nothing was recorded: the earlier misses are
    unknown, and the list is this pass's (as it was)."""
    if offset is None or offset.missing_blobs is None:
        recorded: list[str] = [] if offset is None else list(parsed.missing_blobs)
    else:
        recorded = list(offset.missing_blobs)
    now = set(parsed.missing_blobs)
    if now:
        text = "\n".join(pi.dumps_exact(event) for event in new_events)
        recorded += [ref for ref in parsed.missing_blobs if ref not in recorded and ref in text]
    found = [ref for ref in recorded if ref not in now and ref.encode() in data]
    if found:  # at info level: the import's result lists them (the CLI says so)
        log.info(
            "blobs the session was imported without are found now; the journal is "
            "append-only: delete the session and import the file again to store them",
            extra={"external_id": parsed.header.external_id, "found": found},
        )
    return recorded, found


def _validate(
    store: SessionStore, path: Path, events: Sequence[Any], lines: Sequence[int]
) -> CheckedEvents:
    """Refuse the pass, before anything is written, if the journal would refuse any of its
    events (the check every append makes), naming the event's line of the file; the events,
    checked, for the appends (which do not check them again)."""
    try:
        return checked(events, max_depth=store.settings.max_event_depth)
    except InvalidEvent as exc:
        line = lines[exc.index] if exc.index is not None else lines[0]
        raise InvalidEvent(exc.field, f"{path} line {line}: {exc.reason}") from None


def _batch_key(index: int) -> str:
    """The idempotency key of the batch whose first file event is ``events[index]``."""
    return f"{_KEY_PREFIX}{index}"


def _resumed(store: SessionStore, session_id: str, entries: int) -> int:
    """``entries`` plus the events of batches committed after the last offset update (by a
    pass that died in between, or one running now): each batch's key names its first file
    event. An offset inside a batch (recorded by a pass whose file was shorter than a
    concurrent pass's batch) resumes after that batch."""
    while True:
        prior = store.journal.find_write(session_id, _batch_key(entries))
        if prior is not None:
            entries += prior.last_seq - prior.first_seq + 1
            continue
        end = _covering_batch_end(store, session_id, entries)
        if end is None:
            return entries
        entries = end


def _covering_batch_end(store: SessionStore, session_id: str, index: int) -> int | None:
    """The end of the import batch holding file event ``index`` after its first, if one
    does. Batches commit in file order, so that is the latest batch begun before ``index``
    (one query: nearly always the latest batch of all, the first row the index gives)."""
    found = store.journal.latest_numbered_write(session_id, _KEY_PREFIX, below=index)
    if found is None:
        return None
    start, write = found
    end = start + write.last_seq - write.first_seq + 1
    return end if end > index else None


def _first_differing_line(
    store: SessionStore,
    session: Session,
    events: Sequence[dict[str, Any]],
    lines: Sequence[int],
    count: int,
) -> int | None:
    """The file line of the first of the ``count`` file events imported before that the
    journal does not hold, in order; None if it holds them all. Events appended to the
    session directly may sit between them: the journal's events are matched in order, not
    by seq. A file with fewer events (an older copy, a file read before a concurrent pass
    imported more of it) is unchanged if the journal holds every one of them."""
    count = min(count, len(events))
    found = _held_in_order(store, session, events[:count])
    return None if found == count else lines[found]


def _held_in_order(store: SessionStore, session: Session, events: Sequence[dict[str, Any]]) -> int:
    """How many of ``events``, from the first, the journal holds in their order (others
    may sit between them)."""
    found = 0
    for stored in _stored_events(store, session.id):
        if found == len(events):
            break
        if same_value(_without_transient(events[found]), stored.payload):
            found += 1
    return found


# pi's rewrite of an older file --------------------------------------------------------------

# the entry fields that name another entry
_LINKS = ("id", "parentId", "firstKeptEntryId", "targetId", "fromId")


def _mapped(events: Sequence[dict[str, Any]], id_map: Mapping[str, str]) -> list[dict[str, Any]]:
    """The file's events with the entry ids they name mapped to the stored ones (the header,
    first, names the session: it is kept)."""
    if not id_map:
        return list(events)

    def entry(event: dict[str, Any]) -> dict[str, Any]:
        return {
            k: id_map.get(v, v) if k in _LINKS and isinstance(v, str) else v
            for k, v in event.items()
        }

    return [*events[:1], *(entry(e) for e in events[1:])]


def _rewritten_by_pi(
    store: SessionStore,
    session: Session,
    events: Sequence[dict[str, Any]],
    count: int,
    source_version: int | None,
    limit: int,
) -> _Imported | None:
    """What the session holds of the file if the file is the imported older one after pi
    opened it, else None.

    pi migrates a version-1 or -2 file in place when it opens it (to continue the session):
    every line is written again by ``JSON.stringify`` (numbers as JavaScript's doubles:
    ``0.0`` is ``0``), and a version-1 file's entries get new random ids where the import
    derived its own (``pi.v1_entry_id``). The file is that one if its first ``count`` events
    are the stored file events in order, each the same JavaScript value as its stored event
    but for the entry ids it holds (``_LINKS``), which correspond one to one, and every stored
    id that differs is one the import derived for this session (so a file whose ids were
    changed otherwise, or whose content changed, is refused). Without a recorded source
    version, only derived ids show that the file was older."""
    if count > len(events):
        return None
    forward: dict[str, str] = {}
    backward: dict[str, str] = {}
    derived = _DerivedIds(str(pi.line_value(events[0]).get("id")), limit)
    found = 0
    for stored in _stored_events(store, session.id):
        if found == count:
            break
        # a line kept wrapped is compared as the line: pi wrote it again, with its new ids
        theirs = _js_value(_without_transient(pi.line_value(events[found])))
        ours = _js_value(pi.line_value(stored.payload))
        if found == 0:
            found += same_value(theirs, ours)
            continue
        pairs = _corresponding(theirs, ours, forward, backward)
        if pairs is None:
            continue  # an event appended to the session directly
        if theirs.get("id") != ours.get("id") and not derived.next(ours.get("id")):
            return None
        for mine, stored_id in pairs.items():
            forward[mine], backward[stored_id] = stored_id, mine
        found += 1
    id_map = {mine: ours for mine, ours in forward.items() if mine != ours}
    if found != count or (source_version is None and not id_map):
        return None
    return _Imported(count, 1 if id_map else source_version, id_map)


def _js_value(value: Any) -> Any:
    """A JSON value as JavaScript's ``JSON.parse`` then ``JSON.stringify`` give it back:
    every number a double (``1`` and ``1.0`` alike, ``-0`` is ``0``, beyond a double
    ``null``)."""
    if isinstance(value, dict):
        return {k: _js_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_js_value(v) for v in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            return None
        return None if math.isinf(number) else number + 0.0
    return value


def _corresponding(
    theirs: Any, ours: Any, forward: Mapping[str, str], backward: Mapping[str, str]
) -> dict[str, str] | None:
    """The new id pairs (file id -> stored id) under which the file's entry ``theirs`` is the
    stored ``ours``, consistent with the pairs so far; None if it is not."""
    if not isinstance(theirs, dict) or not isinstance(ours, dict) or theirs.keys() != ours.keys():
        return None
    pairs: dict[str, str] = {}
    back: dict[str, str] = {}
    for key in _LINKS:
        mine, stored = theirs.get(key), ours.get(key)
        if not (isinstance(mine, str) and isinstance(stored, str)):
            if not same_value(mine, stored):
                return None
            continue
        if forward.get(mine, pairs.get(mine, stored)) != stored:
            return None
        if backward.get(stored, back.get(stored, mine)) != mine:
            return None
        pairs[mine], back[stored] = stored, mine
    rest = {k: v for k, v in theirs.items() if k not in _LINKS}
    return pairs if same_value(rest, {k: v for k, v in ours.items() if k not in _LINKS}) else None


class _DerivedIds:
    """The ids ``pi.v1_entry_id`` draws for a session's parsed lines, in file order: each
    stored entry's id must be drawn for a line after the previous one's."""

    def __init__(self, session_id: str, limit: int) -> None:
        self._session_id, self._limit, self._index = session_id, limit, 0

    def next(self, entry_id: Any) -> bool:
        if not isinstance(entry_id, str):
            return False
        while self._index < self._limit:
            self._index += 1
            digest = pi.v1_digest(self._session_id, self._index)
            if entry_id == digest or (len(entry_id) == 8 and entry_id in digest):
                return True
        return False


def _stored_events(store: SessionStore, session_id: str) -> Iterator[StoredEvent]:
    after = 0
    while True:
        page = store.read(session_id, after_seq=after, limit=500, rehydrate=True)
        if not page:
            return
        yield from page
        after = page[-1].seq


def _without_transient(value: Any) -> Any:
    from core.blobs.externalize import TRANSIENT_FIELDS

    if isinstance(value, dict):
        return {k: _without_transient(v) for k, v in value.items() if k not in TRANSIENT_FIELDS}
    if isinstance(value, list):
        return [_without_transient(v) for v in value]
    return value


def _line_sizes(data: bytes, lines: Sequence[int]) -> list[int]:
    """The byte size of each entry's source line (what a batch's size is estimated by)."""
    if not lines:
        return []
    lengths = [len(line) + 1 for line in data.split(b"\n", max(lines))]
    return [lengths[n - 1] if 0 < n <= len(lengths) else 0 for n in lines]


def _batch_end(sizes: Sequence[int], start: int, *, max_events: int, max_bytes: int) -> int:
    """The end of the run of events from ``start`` within the journal's limits per write."""
    total, stop = 0, min(len(sizes), start + max_events)
    for index in range(start, stop):
        if index > start and total + sizes[index] > max_bytes:
            return index
        total += sizes[index]
    return stop


def _append(
    store: SessionStore,
    session: Session,
    pending: CheckedEvents,
    sizes: Sequence[int],
    start: int,
    head: int,
) -> Iterator[tuple[int, bool]]:
    """Append the file events from ``start`` (``pending``: those from ``start`` on, checked)
    in batches; yields how many events each batch holds, and whether this pass appended it
    (else a concurrent import of the file did).

    ``head`` is the session's head as it was before the pass found where to resume. Each
    append expects the head the pass last saw: anything appended since (a concurrent
    import's batches, cut at other lines) fails it with a conflict instead of being
    appended after, and the pass resumes from what the journal holds then."""
    settings = store.settings
    index, stop, stalled = start, start + len(pending), 0
    while index < stop:
        end = _batch_end(
            sizes,
            index,
            max_events=max(1, settings.max_batch_events),
            # half the byte limit: a line's size only estimates its event's encoded size
            max_bytes=max(1, settings.max_write_bytes // 2),
        )
        try:
            result = store.append(
                session.id,
                pending[index - start : end - start],
                expected_seq=head,
                idempotency_key=_batch_key(index),
            )
        except (ConcurrencyConflict, IdempotencyKeyReused) as exc:
            conflict: SessionStoreError | None = exc
        else:
            if not result.replayed:
                index, head, stalled = end, result.last_seq, 0
                yield result.last_seq - result.first_seq + 1, True
                continue
            conflict = None  # this very batch, committed by a concurrent import
        # The head first: a batch committed after it fails the next append again.
        head = store.journal.get_session(session.id).head_seq
        resumed = _resumed(store, session.id, index)
        if resumed > index:
            yield min(resumed, stop) - index, False
            index, stalled = resumed, 0
        elif (stalled := stalled + 1) >= _CONFLICT_ATTEMPTS:
            # others keep appending to the session: the next pass goes on
            raise conflict or ConcurrencyConflict(session.id, head, head)


# appends to the session from elsewhere, one after another, that a pass waits out
_CONFLICT_ATTEMPTS = 5


def _save_offset(
    store: SessionStore,
    session_id: str,
    path: Path,
    parsed: ParsedSession,
    entries: int,
    data: bytes,
    held: _Imported,
    missing_blobs: list[str],
) -> None:
    consumed = parsed.consumed_bytes
    with write_transaction(store.engine) as conn:
        conn.execute(
            update(_offsets)
            # never back: a pass that read the file shorter than a concurrent pass, and
            # finished after it, would have the next pass append the difference again
            .where(_offsets.c.session_id == session_id, _offsets.c.entries <= entries)
            .values(
                path=_resolved(path),
                format=parsed.format,
                consumed_bytes=consumed,
                lines=data.count(b"\n", 0, consumed),
                entries=entries,
                prefix_sha256=hashlib.sha256(data[:consumed]).hexdigest(),
                source_version=held.source_version,
                **_parent_refs(parsed),
                id_map=json.dumps(held.id_map, sort_keys=True) if held.id_map else None,
                missing_blobs=json.dumps(missing_blobs),
                updated_at=utcnow(),
            )
        )


def _parent_refs(parsed: ParsedSession) -> dict[str, str | None]:
    """The parent pi's ``parentSession`` names (the parent file's path): the path resolved,
    and the session id its file name ends with (``<timestamp>_<id>.jsonl``); or the one a
    header names by its id (``SessionHeader.parent_id``)."""
    header = parsed.header
    ref = header.parent_id or header.parent_session
    # No session's id holds a U+0000, and no PostgreSQL text can: such a ref names no
    # session (the file's header event keeps it as written).
    if not ref or "\x00" in ref:
        return {"parent_path": None, "parent_external": None}
    if header.parent_id is not None:  # named by its id, not by a file
        return {"parent_path": None, "parent_external": ref}
    try:
        resolved: str | None = _resolved(Path(ref).expanduser())
    except (OSError, ValueError):
        resolved = None
    return {
        "parent_path": resolved,
        "parent_external": key_text(Path(ref).stem.rsplit("_", 1)[-1]),
    }


def _resolved(path: Path) -> str:
    """The text a file's path is stored and matched by: resolved, and a name that is not
    UTF-8 escaped (``path_text``), which no database could store as it is. A path through
    a loop of links is an OSError (ELOOP), as opening it would be."""
    try:
        resolved = path.resolve()
    except RuntimeError as exc:  # Python < 3.13 reports a link loop so
        raise OSError(errno.ELOOP, str(exc), str(path)) from None
    return path_text(resolved)


def _link_parent(
    store: SessionStore, session: Session, parsed: ParsedSession, tenant_id: str
) -> None:
    """pi's ``parentSession`` (the parent file's path) becomes a fork link once the parent
    is imported too. Nothing is inherited (``forked_from_seq`` stays None): a pi fork's file
    holds its own copy of the entries. A child imported first is linked by its parent's
    pass (``_link_children``); each pass records its reference before either looks."""
    refs = _parent_refs(parsed)
    if session.parent_id is not None or refs["parent_external"] is None:
        return
    parent = _parent_of(store, tenant_id, refs["parent_path"], refs["parent_external"])
    if parent is not None and parent.id != session.id:
        _set_parent(store, session.id, parent.id)


def _link_children(store: SessionStore, session: Session, path: Path, tenant_id: str) -> None:
    """Link the sessions imported before this one whose header names it as their parent (by
    the rule ``_link_parent`` applies: the file's path first, then the id in its name)."""
    mine = _resolved(path)
    with read_connection(store.engine) as conn:
        rows = conn.execute(
            select(_offsets.c.session_id, _offsets.c.parent_path, _offsets.c.parent_external)
            .join(_sessions, _sessions.c.id == _offsets.c.session_id)
            .where(
                _sessions.c.tenant_id == tenant_id,
                _sessions.c.parent_id.is_(None),
                _sessions.c.id != session.id,
                (_offsets.c.parent_path == mine)
                | (_offsets.c.parent_external == session.external_id),
            )
        ).all()
    for row in rows:
        parent = _parent_of(store, tenant_id, row.parent_path, row.parent_external)
        if parent is not None and parent.id == session.id:
            _set_parent(store, row.session_id, session.id)


def _parent_of(
    store: SessionStore, tenant_id: str, parent_path: str | None, parent_external: str | None
) -> Session | None:
    by_path = (
        _session_of_path(store, parent_path, tenant_id, parent_external) if parent_path else None
    )
    if by_path is not None or parent_external is None:
        return by_path
    return store.journal.find_external(tenant_id, parent_external)


def _fill_row(store: SessionStore, session: Session, parsed: ParsedSession) -> None:
    """What a later pass of a file being written learns, in the session's row:
    - the file's title, once it has one other than the session's: a title comes later than
      the first pass (Claude Code's ``/rename``, pi's session name), and the last one is
      the session's; the file is where an imported session's title comes from;
    - its working directory, while the row has none: a Claude Code file's first lines (a
      summary, a file-history snapshot) carry none, and a first pass that read only them
      left the session without one. ``state`` takes the row's when the header has none.
      The header (seq 1) stays as that pass built it, and an export writes it as stored,
      so the export goes back into its session as the same lines. Only a row without one
      is given it (in the statement: a concurrent ``sessions move --cwd`` stands).
    """
    title, cwd = parsed.header.title, parsed.header.cwd  # as the row holds text
    retitle = title is not None and (title or None) != session.title
    give_cwd = bool(cwd) and session.cwd is None
    if not (retitle or give_cwd):
        return  # no write (a pass that brings nothing takes no lock)
    with write_transaction(store.engine) as conn:
        if retitle:
            conn.execute(
                update(_sessions).where(_sessions.c.id == session.id).values(title=title or None)
            )
        if give_cwd:
            conn.execute(
                update(_sessions)
                .where(_sessions.c.id == session.id, _sessions.c.cwd.is_(None))
                .values(cwd=cwd)
            )


def _set_parent(store: SessionStore, session_id: str, parent_id: str) -> None:
    with write_transaction(store.engine) as conn:
        conn.execute(
            update(_sessions)
            .where(_sessions.c.id == session_id, _sessions.c.parent_id.is_(None))
            .values(parent_id=parent_id)
        )


def _session_of_path(
    store: SessionStore, resolved: str, tenant_id: str, external_id: str | None
) -> Session | None:
    """The session imported from the file at ``resolved``. A path used again for another
    session (the old file removed, pi restarting a file it could not read) names two: the
    one whose id the reference's file name ends with, else the one imported from it last."""
    with read_connection(store.engine) as conn:
        rows = conn.execute(
            select(_offsets.c.session_id, _sessions.c.external_id)
            .join(_sessions, _sessions.c.id == _offsets.c.session_id)
            .where(_offsets.c.path == resolved, _sessions.c.tenant_id == tenant_id)
            .order_by(_offsets.c.updated_at.desc(), _sessions.c.created_at.desc())
        ).all()
    named = [row for row in rows if external_id is not None and row.external_id == external_id]
    chosen = named or rows
    return store.journal.get_session(chosen[0].session_id) if chosen else None
