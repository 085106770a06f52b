"""Analysts' queries over the journal: filtered event listings, a follower, and stats.

Listings are cursor-paginated by global position; stats are aggregated by the database.
Nothing here reads a whole table into memory.

Following relies on DESIGN invariant 4: writers are serialized, so positions become visible
in order, and once position ``h`` is visible no smaller position can still appear. A follower
can therefore move its cursor to the head it saw, even past rows its filter rejected.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    LargeBinary,
    Numeric,
    Select,
    String,
    Text,
    and_,
    case,
    cast,
    func,
    select,
)
from sqlalchemy.sql.elements import ColumnElement

from core.db import is_sqlite, keyset_pages, read_connection
from core.errors import InvalidArgument
from core.journal.validation import check_limit, check_name, check_names, check_seq
from core.models import BlobRefRow, BlobRow, EventRow, SessionRow, table_of
from core.query import timeblocks
from core.query.entry_time import bound_us, entry_us
from core.records import Page
from core.translate import storage_errors, translated

_events = table_of(EventRow)
_sessions = table_of(SessionRow)
_refs = table_of(BlobRefRow)
_blobs = table_of(BlobRow)

MAX_PAGE = 10_000
log = logging.getLogger(__name__)
_TOKEN_FIELDS = ("input", "output", "cacheRead", "cacheWrite", "totalTokens")


@dataclass(frozen=True, slots=True)
class EventFilter:
    """Which events to list. Roles match ``message`` events by ``message.role``.

    ``since`` is inclusive and ``until`` exclusive, on the time the journal recorded the event
    (``events.recorded_at``). ``entry_since``/``entry_until`` (same bounds) filter on the
    entry's own time, the payload's ``timestamp`` as the agent wrote it: ISO 8601 text or epoch
    milliseconds, read as ``core.query.entry_time`` defines (the same on every backend, to the
    millisecond). An event without such a ``timestamp`` never matches an entry bound.
    """

    tenant_id: str | None = None
    session_id: str | None = None
    types: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    since: datetime | None = None
    until: datetime | None = None
    entry_since: datetime | None = None
    entry_until: datetime | None = None

    def __post_init__(self) -> None:
        check_name(self.tenant_id, "tenant_id")
        check_name(self.session_id, "session_id")
        for field in ("types", "roles"):
            check_names(getattr(self, field), field)


@dataclass(frozen=True, slots=True)
class ListedEvent:
    position: int
    session_id: str
    tenant_id: str
    seq: int
    type: str
    recorded_at: datetime
    payload: dict[str, Any]

    @property
    def role(self) -> str | None:
        message = self.payload.get("message") if self.type == "message" else None
        role = message.get("role") if isinstance(message, dict) else None
        return role if isinstance(role, str) else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "session_id": self.session_id,
            "tenant_id": self.tenant_id,
            "seq": self.seq,
            "type": self.type,
            "role": self.role,
            "recorded_at": self.recorded_at.isoformat(),
            "payload": self.payload,
        }


# SQL per dialect ------------------------------------------------------------------------


def _json_text(engine: Engine, *path: str) -> ColumnElement[Any]:
    """The value at ``path`` if it is a JSON string, else NULL: the same on both backends
    (SQLite's ``json_extract`` gives a number or a boolean as one, PostgreSQL's text gives
    its JSON text), and as the fold reads a role or a model (a string, or none)."""
    if is_sqlite(engine):
        where = "$." + ".".join(path)
        kind = func.json_type(_events.c.payload, where)
        return case((kind == "text", func.json_extract(_events.c.payload, where)))
    node = func.json_extract_path(_events.c.payload, *path)
    return case(
        (func.json_typeof(node) == "string", func.json_extract_path_text(_events.c.payload, *path))
    )


def _json_number(engine: Engine, *path: str) -> ColumnElement[Any]:
    """The value at ``path`` if it is a JSON number (booleans and strings are not)."""
    if is_sqlite(engine):
        where = "$." + ".".join(path)
        kind = func.json_type(_events.c.payload, where)
        return case((kind.in_(["integer", "real"]), func.json_extract(_events.c.payload, where)))
    node = func.json_extract_path(_events.c.payload, *path)
    return case(
        (
            func.json_typeof(node) == "number",
            cast(func.json_extract_path_text(_events.c.payload, *path), Numeric),
        )
    )


def _payload_bytes(engine: Engine) -> ColumnElement[Any]:
    """Size of the payload's JSON text as the backend stores or renders it."""
    if is_sqlite(engine):
        return func.length(cast(_events.c.payload, LargeBinary))
    return func.octet_length(cast(_events.c.payload, Text))


def _day(engine: Engine) -> ColumnElement[Any]:
    if is_sqlite(engine):
        return func.substr(cast(_events.c.recorded_at, String), 1, 10)
    return func.to_char(func.timezone("UTC", _events.c.recorded_at), "YYYY-MM-DD")


def _tenant_sessions(tenant_id: str) -> Select[Any]:
    return select(_sessions.c.id).where(_sessions.c.tenant_id == tenant_id)


def _scope(
    engine: Engine,
    flt: EventFilter,
    *,
    after: int | None = None,
    upto: int | None = None,
) -> list[ColumnElement[bool]]:
    clauses: list[ColumnElement[bool]] = []
    if after is not None:
        clauses.append(_events.c.position > after)
    if upto is not None:
        clauses.append(_events.c.position <= upto)
    if flt.tenant_id is not None:
        clauses.append(_events.c.session_id.in_(_tenant_sessions(flt.tenant_id)))
    if flt.session_id is not None:
        clauses.append(_events.c.session_id == flt.session_id)
    if flt.types:
        clauses.append(_events.c.type.in_(list(flt.types)))
    if flt.roles:
        clauses.append(
            and_(
                _events.c.type == "message",
                _json_text(engine, "message", "role").in_(list(flt.roles)),
            )
        )
    if flt.since is not None:
        clauses.append(_events.c.recorded_at >= flt.since)
    if flt.until is not None:
        clauses.append(_events.c.recorded_at < flt.until)
    if flt.entry_since is not None:
        clauses.append(entry_us(engine) >= bound_us(flt.entry_since))
    if flt.entry_until is not None:
        clauses.append(entry_us(engine) < bound_us(flt.entry_until))
    return clauses


# listing --------------------------------------------------------------------------------


def _listing(
    conn: Connection,
    engine: Engine,
    flt: EventFilter,
    *,
    after: int,
    upto: int | None,
    limit: int,
) -> list[ListedEvent]:
    query = (
        select(
            _events.c.position,
            _events.c.session_id,
            _sessions.c.tenant_id,
            _events.c.seq,
            _events.c.type,
            _events.c.recorded_at,
            _events.c.payload,
        )
        .join(_sessions, _sessions.c.id == _events.c.session_id)
        .where(*_scope(engine, flt, after=after, upto=upto))
        .order_by(_events.c.position)
        .limit(limit)
    )
    return [ListedEvent(*row) for row in conn.execute(query)]


def _time_floor(engine: Engine, flt: EventFilter, after: int) -> int:
    """``after``, moved up to just before the first position that can match the filter's
    lower time bounds (see ``core.query.timeblocks``): the same results, a shorter scan."""
    if flt.since is None and flt.entry_since is None:
        return after
    first = timeblocks.first_position_at_or_after(engine, recorded=flt.since, entry=flt.entry_since)
    return max(after, first - 1)


@translated
def list_events(
    engine: Engine,
    flt: EventFilter | None = None,
    *,
    after_position: int = 0,
    limit: int = 100,
) -> Page:
    """One page of matching events by position; ``next_cursor`` is the position to continue
    after (pass it back as ``after_position``), or None at the end."""
    check_seq(after_position, "after_position")
    limit = min(check_limit(limit), MAX_PAGE)
    flt = flt or EventFilter()
    after = _time_floor(engine, flt, after_position)
    with read_connection(engine) as conn:
        rows = _listing(conn, engine, flt, after=after, upto=None, limit=limit + 1)
    items = rows[:limit]
    return Page(items=items, next_cursor=str(items[-1].position) if len(rows) > limit else None)


def iter_events(
    engine: Engine,
    flt: EventFilter | None = None,
    *,
    after_position: int = 0,
    page_size: int = 1000,
) -> Iterator[ListedEvent]:
    """Every matching event after ``after_position``, a page at a time."""

    def fetch(cursor: int, size: int) -> list[ListedEvent]:
        return list(list_events(engine, flt, after_position=cursor, limit=size).items)

    # a page is at most MAX_PAGE (list_events cuts it): a larger size would read a short
    # page as the end
    size = min(check_limit(page_size, "page_size"), MAX_PAGE)
    return keyset_pages(fetch, lambda e: e.position, after=after_position, size=size)


def _head(conn: Connection) -> int:
    return int(conn.execute(select(func.coalesce(func.max(_events.c.position), 0))).scalar_one())


@translated
def head_position(engine: Engine) -> int:
    """The largest position committed so far (0 for an empty journal)."""
    with read_connection(engine) as conn:
        return _head(conn)


MAX_POLL_S = 3600  # an idle follower polls at least hourly (and time.sleep has a bound)


def follow_events(
    engine: Engine,
    flt: EventFilter | None = None,
    *,
    after_position: int,
    poll_interval: float = 0.5,
    page_size: int = 1000,
    should_stop: Callable[[], bool] = lambda: False,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[ListedEvent]:
    """Matching events after ``after_position``, then new ones as they commit, each once.

    Polls every ``poll_interval`` seconds while idle; stops when ``should_stop()`` is true
    (checked between polls) or when the consumer stops iterating.
    """
    check_seq(after_position, "after_position")
    poll = poll_interval
    if type(poll) not in (int, float) or not 0 <= poll <= MAX_POLL_S:  # NaN fails too
        raise InvalidArgument("poll_interval", f"must be seconds in 0..{MAX_POLL_S}, not {poll!r}")
    flt = flt or EventFilter()
    with storage_errors():
        position = _time_floor(engine, flt, after_position)
    while True:
        with storage_errors(), read_connection(engine) as conn:
            head = _head(conn)
            rows = _listing(conn, engine, flt, after=position, upto=head, limit=page_size)
        yield from rows
        if len(rows) == page_size:
            position = rows[-1].position
            continue
        # everything up to ``head`` is visible now and was scanned (invariant 4)
        position = max(position, head)
        if should_stop():
            return
        sleep(poll_interval)
