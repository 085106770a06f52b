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
  record says how many events it held), and two importers of one file never double it;
  appends carry ``expected_seq`` too, so they never interleave;
- every event a pass would append is checked first, as an append checks it: a bad one fails
  the pass with ``InvalidEvent`` naming its line, and nothing is written (no session either);
- a failure while writing (the database, the blob store, an artifact) raises
  ``ImportInterrupted``, which says what was appended to which session: that stays, and
  the next pass continues after it;
- a last line without its newline is an agent mid-write: it is left for the next pass.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import insert, select, update

from core.db import read_connection, write_transaction
from core.errors import (
    ImportConflict,
    ImportFormatError,
    ImportInterrupted,
    InvalidEvent,
    SessionStoreError,
    UnreadableFile,
)
from core.exact_json import same_value
from core.interop import pi
from core.interop.model import IgnoredLine, ParsedSession
from core.journal.validation import check_event
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
    missing_blobs: list[str] = field(default_factory=list)
    # lines read with U+FFFD for invalid UTF-8, as pi reads them (the stored text differs)
    invalid_utf8_lines: int = 0
    # lines of the file that hold no entry (not JSON, not an object, no string type): not
    # imported, each with its line and why
    ignored_lines: list[IgnoredLine] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Offset:
    consumed_bytes: int
    lines: int
    entries: int
    prefix_sha256: str


def import_session(
    store: SessionStore,
    path: str | Path,
    *,
    tenant_id: str,
    format: str = "auto",
    options: Mapping[str, Any] | None = None,
) -> ImportResult:
    """Import (or continue importing) one session file; see the module docstring.
    ``options`` go to the format's parser (oh-my-pi: ``blobs_dir``)."""
    path = Path(path)
    data = read_file(path)
    parsed = parse_file_data(path, data, format=format, options=options)
    events = [pi.header_event(parsed.header), *(e.entry for e in parsed.entries)]
    lines = [1, *(e.line for e in parsed.entries)]
    external_id = parsed.header.external_id
    _check_session_fields(path, parsed)
    session = store.journal.find_external(tenant_id, external_id)
    offset = _offset_of(store, session.id) if session else None
    skipped = _imported(store, path, data, session, offset, events, lines) if session else 0
    _validate(store, path, events[skipped:], lines[skipped:])
    if session is None:
        session = _create(store, parsed, path, tenant_id)
    elif offset is None:  # adopt an empty named session (``sessions create --id``)
        _insert_offset(store, session.id, path, parsed.format)
    sizes = _line_sizes(data, lines)
    appended = 0
    try:
        for count in _append(store, session, events, sizes, skipped):
            appended += count
        _save_offset(store, session.id, path, parsed, len(events), data)
        after = converters()[parsed.format].after_import
        if after is not None:  # every pass: a pass that failed here runs it again
            after(store, session.id, parsed)
        _link_parent(store, session, parsed, tenant_id)
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
    status: ImportStatus = "created" if skipped == 0 else "appended" if appended else "unchanged"
    result = ImportResult(
        path=str(path),
        session_id=session.id,
        external_id=external_id,
        format=parsed.format,
        status=status,
        appended=appended,
        skipped=skipped,
        incomplete_tail=parsed.incomplete_tail,
        missing_blobs=list(parsed.missing_blobs),
        invalid_utf8_lines=parsed.invalid_utf8_lines,
        ignored_lines=list(parsed.ignored_lines),
    )
    log.info("imported a session file", extra=result.to_dict())
    observed = metrics()
    observed.import_entries.inc(appended)
    observed.import_bytes.inc(sum(sizes[skipped:]))
    return result


def parse_file_data(
    path: Path,
    data: bytes,
    *,
    format: str = "auto",
    options: Mapping[str, Any] | None = None,
) -> ParsedSession:
    if format == "auto":
        format = detect_format(path, data)
    converter = converters().get(format)
    if converter is None:
        known = ", ".join(sorted(converters()))
        raise ImportFormatError(str(path), f"unknown format {format!r} (known: {known})")
    # a run over several formats passes each one's options (oh-my-pi's blobs_dir) to all
    mine = {k: v for k, v in (options or {}).items() if k in converter.options}
    try:
        return converter.parse(path, data, **mine)
    except SessionStoreError:
        raise
    except Exception as exc:
        # A converter's own failure on odd input is still this file's typed error: the
        # caller (a run over many files) reports it and goes on with the next file.
        log.exception("a converter failed", extra={"path": str(path), "format": format})
        raise ImportFormatError(
            str(path), f"the {format} reader failed on this file: {type(exc).__name__}: {exc}"
        ) from exc


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
    session = store.journal.create_session(
        tenant_id=tenant_id, title=header.title, cwd=header.cwd, external_id=header.external_id
    )
    # The offset row exists from the start: a session of this external id without one was
    # not made by an import (``sessions create --id``) and is adopted only while empty.
    _insert_offset(store, session.id, path, parsed.format)
    return session


def _insert_offset(store: SessionStore, session_id: str, path: Path, format: str) -> None:
    with write_transaction(store.engine) as conn:
        conn.execute(
            insert(_offsets).values(
                session_id=session_id,
                path=str(path.resolve()),
                format=format,
                consumed_bytes=0,
                lines=0,
                entries=0,
                prefix_sha256=hashlib.sha256(b"").hexdigest(),
                updated_at=utcnow(),
            )
        )


def _offset_of(store: SessionStore, session_id: str) -> _Offset | None:
    with read_connection(store.engine) as conn:
        row = conn.execute(select(_offsets).where(_offsets.c.session_id == session_id)).first()
    if row is None:
        return None
    return _Offset(row.consumed_bytes, row.lines, row.entries, row.prefix_sha256)


def _imported(
    store: SessionStore,
    path: Path,
    data: bytes,
    session: Session,
    offset: _Offset | None,
    events: Sequence[dict[str, Any]],
    lines: Sequence[int],
) -> int:
    """How many of the file's events the session holds; ``ImportConflict`` (before anything
    is written) if the part of the file already imported is not what the session has."""
    if offset is None:
        if session.head_seq == 0:  # an empty named session (``sessions create --id``)
            return 0
        raise ImportConflict(
            str(path), 1, f"session {session.id} has this id but was not imported from a file"
        )
    done = _resumed(store, session.id, offset.entries)
    prefix = data[: offset.consumed_bytes]
    if (
        len(data) >= offset.consumed_bytes
        and hashlib.sha256(prefix).hexdigest() == offset.prefix_sha256
        and done <= len(events)
    ):
        return done
    # The bytes differ (another path, an export of the session, an edit): what counts is
    # whether any imported entry's value changed.
    line = _first_differing_line(store, session, events, lines, done)
    if line is not None:
        raise ImportConflict(str(path), line, "the already-imported part of the file changed")
    log.info(
        "the imported part was re-serialized with the same values",
        extra={"path": str(path), "session_id": session.id},
    )
    return done


def _validate(store: SessionStore, path: Path, events: Sequence[Any], lines: Sequence[int]) -> None:
    """Refuse the pass, before anything is written, if the journal would refuse any of its
    events (the check every append makes), naming the event's line of the file."""
    max_depth = store.settings.max_event_depth
    for event, line in zip(events, lines, strict=True):
        try:
            check_event(event, max_depth=max_depth)
        except InvalidEvent as exc:
            raise InvalidEvent(exc.field, f"{path} line {line}: {exc.reason}") from None


def _batch_key(index: int) -> str:
    """The idempotency key of the batch whose first file event is ``events[index]``."""
    return f"{_KEY_PREFIX}{index}"


def _resumed(store: SessionStore, session_id: str, entries: int) -> int:
    """``entries`` plus the events of batches a pass committed after its last offset update
    (it died in between): each batch's key names its first file event."""
    while (prior := store.journal.find_write(session_id, _batch_key(entries))) is not None:
        entries += prior.last_seq - prior.first_seq + 1
    return entries


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
    by seq."""
    if count > len(events):
        return lines[-1] + 1  # the file lost entries: the first missing one
    found = 0
    for stored in _stored_events(store, session.id):
        if found == count:
            break
        if same_value(_without_transient(events[found]), stored.payload):
            found += 1
    return None if found == count else lines[found]


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
    events: Sequence[dict[str, Any]],
    sizes: Sequence[int],
    start: int,
) -> Iterator[int]:
    """Append the file events from ``start`` in batches; yields how many each appended."""
    settings = store.settings
    head, index = session.head_seq, start
    while index < len(events):
        end = _batch_end(
            sizes,
            index,
            max_events=max(1, settings.max_batch_events),
            # half the byte limit: a line's size only estimates its event's encoded size
            max_bytes=max(1, settings.max_write_bytes // 2),
        )
        # expected_seq: a concurrent writer fails this instead of interleaving; the key: a
        # batch already committed (by a pass that died, or a concurrent importer) is replayed
        result = store.append(
            session.id, events[index:end], expected_seq=head, idempotency_key=_batch_key(index)
        )
        index += result.last_seq - result.first_seq + 1
        if result.replayed:
            head = store.journal.get_session(session.id).head_seq
        else:
            head = result.last_seq
            yield result.last_seq - result.first_seq + 1


def _save_offset(
    store: SessionStore,
    session_id: str,
    path: Path,
    parsed: ParsedSession,
    entries: int,
    data: bytes,
) -> None:
    consumed = parsed.consumed_bytes
    with write_transaction(store.engine) as conn:
        conn.execute(
            update(_offsets)
            .where(_offsets.c.session_id == session_id)
            .values(
                path=str(path.resolve()),
                format=parsed.format,
                consumed_bytes=consumed,
                lines=data.count(b"\n", 0, consumed),
                entries=entries,
                prefix_sha256=hashlib.sha256(data[:consumed]).hexdigest(),
                updated_at=utcnow(),
            )
        )


def _link_parent(
    store: SessionStore, session: Session, parsed: ParsedSession, tenant_id: str
) -> None:
    """pi's ``parentSession`` (the parent file's path) becomes a fork link once the parent
    is imported too. Nothing is inherited (``forked_from_seq`` stays None): a pi fork's file
    holds its own copy of the entries."""
    ref = parsed.header.parent_session
    if not ref or session.parent_id is not None:
        return
    parent = _session_of_path(store, ref, tenant_id) or store.journal.find_external(
        tenant_id, Path(ref).stem.rsplit("_", 1)[-1]
    )
    if parent is None or parent.id == session.id:
        return
    with write_transaction(store.engine) as conn:
        conn.execute(
            update(_sessions)
            .where(_sessions.c.id == session.id, _sessions.c.parent_id.is_(None))
            .values(parent_id=parent.id)
        )


def _session_of_path(store: SessionStore, ref: str, tenant_id: str) -> Session | None:
    try:
        resolved = str(Path(ref).expanduser().resolve())
    except (OSError, ValueError):
        return None
    with read_connection(store.engine) as conn:
        row = conn.execute(
            select(_offsets.c.session_id)
            .join(_sessions, _sessions.c.id == _offsets.c.session_id)
            .where(_offsets.c.path == resolved, _sessions.c.tenant_id == tenant_id)
        ).first()
    return store.journal.get_session(row.session_id) if row else None
