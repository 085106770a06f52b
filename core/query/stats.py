"""Analysts' figures over the journal: events per type and day, sessions, top sessions,
tokens (and per day and model), blob dedup, artifacts. Every sum is overflow-safe."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Select,
    case,
    desc,
    func,
    select,
)
from sqlalchemy.exc import OperationalError
from sqlalchemy.sql.elements import ColumnElement

from core.artifacts import stats_by_kind
from core.blobs.store import BlobIndex
from core.db import is_sqlite, read_connection
from core.journal.usage import saturate
from core.query.analytics import (
    _TOKEN_FIELDS,
    EventFilter,
    _blobs,
    _day,
    _events,
    _json_number,
    _json_text,
    _payload_bytes,
    _refs,
    _scope,
    _sessions,
    _tenant_sessions,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SessionSize:
    session_id: str
    tenant_id: str
    events: int
    payload_bytes: int
    blob_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.payload_bytes + self.blob_bytes


@dataclass(frozen=True, slots=True)
class TokenTotals:
    """Sums of ``message.usage`` over message events (every branch)."""

    input: int | float = 0
    output: int | float = 0
    cache_read: int | float = 0
    cache_write: int | float = 0
    total_tokens: int | float = 0
    cost: int | float = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class DayModelUsage:
    """Tokens of one model on one day (UTC, from the entries' own ``timestamp``).

    ``responses`` counts assistant messages, except the continuation lines of a response
    an importer split over several entries (Claude Code's ``claudeCode.responseLine`` > 0),
    whose usage is only what they add to the response.
    """

    day: str
    model: str | None
    responses: int
    tokens: TokenTotals

    def to_dict(self) -> dict[str, Any]:
        return {
            "day": self.day,
            "model": self.model,
            "responses": self.responses,
            **self.tokens.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class BlobSummary:
    """``referenced_bytes``: what the refs stand for, each reference counted;
    ``unique_bytes``: the distinct blobs they point at. Their ratio is the dedup ratio."""

    references: int
    referenced_bytes: int
    unique_blobs: int
    unique_bytes: int

    @property
    def dedup_ratio(self) -> float | None:
        return self.referenced_bytes / self.unique_bytes if self.unique_bytes else None


@dataclass(frozen=True, slots=True)
class Stats:
    events: int
    sessions: int
    active_sessions: int
    events_by_type: dict[str, int]
    events_by_day: list[tuple[str, int]]
    top_by_events: list[SessionSize]
    top_by_bytes: list[SessionSize]
    tokens: TokenTotals
    blobs: BlobSummary
    artifact_bytes: dict[str, int] = field(default_factory=dict)
    artifact_count: dict[str, int] = field(default_factory=dict)
    usage_by_day: list[DayModelUsage] = field(default_factory=list)
    # events a fork copied from its parent, in scope; counted in the figures above only when
    # ``include_inherited`` (otherwise each event counts once, in the session that wrote it)
    inherited_events: int = 0
    include_inherited: bool = False

    def to_dict(self) -> dict[str, Any]:
        def size(s: SessionSize) -> dict[str, Any]:
            return {
                "session_id": s.session_id,
                "tenant_id": s.tenant_id,
                "events": s.events,
                "payload_bytes": s.payload_bytes,
                "blob_bytes": s.blob_bytes,
                "total_bytes": s.total_bytes,
            }

        return {
            "events": self.events,
            "inherited_events": self.inherited_events,
            "include_inherited": self.include_inherited,
            "sessions": self.sessions,
            "active_sessions": self.active_sessions,
            "events_by_type": self.events_by_type,
            "events_by_day": [{"day": d, "events": n} for d, n in self.events_by_day],
            "top_sessions_by_events": [size(s) for s in self.top_by_events],
            "top_sessions_by_bytes": [size(s) for s in self.top_by_bytes],
            "tokens": self.tokens.to_dict(),
            "usage_by_day": [u.to_dict() for u in self.usage_by_day],
            "blobs": {
                "references": self.blobs.references,
                "referenced_bytes": self.blobs.referenced_bytes,
                "unique_blobs": self.blobs.unique_blobs,
                "unique_bytes": self.blobs.unique_bytes,
                "dedup_ratio": self.blobs.dedup_ratio,
            },
            "artifacts": {
                "bytes": sum(self.artifact_bytes.values()),
                "count": sum(self.artifact_count.values()),
                "bytes_by_kind": self.artifact_bytes,
                "count_by_kind": self.artifact_count,
            },
        }


def _plain(value: Any) -> int | float:
    """Database sums (Decimal on PostgreSQL) as int when integral, else float."""
    if value is None:
        return 0
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    return value if isinstance(value, (int, float)) else float(value)


def stats(
    engine: Engine,
    *,
    tenant_id: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    top: int = 10,
    include_inherited: bool = False,
) -> Stats:
    """Journal stats over events recorded in [since, until); blob and artifact figures are
    current totals (not time-filtered), scoped to the tenant when one is given.

    A fork's copies of its parent's events are left out unless ``include_inherited``: each
    event counts once across a fork tree, in the session that wrote it; with it, every
    session counts all of its events.
    """
    flt = EventFilter(tenant_id=tenant_id, since=since, until=until)
    in_scope = _scope(engine, flt)
    scope = in_scope if include_inherited else [*in_scope, _events.c.inherited.is_(False)]
    top = max(1, min(top, 1000))
    with read_connection(engine) as conn:
        by_type = {
            t: int(n)
            for t, n in conn.execute(
                select(_events.c.type, func.count())
                .where(*scope)
                .group_by(_events.c.type)
                .order_by(_events.c.type)
            )
        }
        day = _day(engine).label("day")
        by_day = [
            (str(d), int(n))
            for d, n in conn.execute(
                select(day, func.count()).where(*scope).group_by(day).order_by(day)
            )
        ]
        sessions_query = select(func.count()).select_from(_sessions)
        if tenant_id is not None:
            sessions_query = sessions_query.where(_sessions.c.tenant_id == tenant_id)
        sessions = int(conn.execute(sessions_query).scalar_one())
        active = int(
            conn.execute(
                select(func.count(func.distinct(_events.c.session_id))).where(*scope)
            ).scalar_one()
        )
        by_events = _top_sessions(conn, engine, scope, top, by_bytes=False)
        by_bytes = _top_sessions(conn, engine, scope, top, by_bytes=True)
        tokens = _token_totals(conn, engine, scope)
        usage_by_day = _usage_by_day(conn, engine, scope)
        inherited = int(
            conn.execute(
                select(func.count()).where(*in_scope, _events.c.inherited.is_(True))
            ).scalar_one()
        )
        blobs = _blob_summary(conn, engine, tenant_id)
    artifacts = stats_by_kind(engine, tenant_id=tenant_id)
    return Stats(
        events=sum(by_type.values()),
        sessions=sessions,
        active_sessions=active,
        events_by_type=by_type,
        events_by_day=by_day,
        top_by_events=by_events,
        top_by_bytes=by_bytes,
        tokens=tokens,
        blobs=blobs,
        artifact_bytes={kind: s.total_bytes for kind, s in artifacts.items()},
        artifact_count={kind: s.count for kind, s in artifacts.items()},
        usage_by_day=usage_by_day,
        inherited_events=inherited,
        include_inherited=include_inherited,
    )


def _top_sessions(
    conn: Connection,
    engine: Engine,
    scope: Sequence[ColumnElement[bool]],
    top: int,
    *,
    by_bytes: bool,
) -> list[SessionSize]:
    per_session = (
        select(
            _events.c.session_id.label("session_id"),
            func.count().label("events"),
            func.coalesce(func.sum(_payload_bytes(engine)), 0).label("payload_bytes"),
        )
        .where(*scope)
        .group_by(_events.c.session_id)
        .subquery()
    )
    blob_bytes = (
        select(_refs.c.session_id.label("session_id"), func.sum(_refs.c.size).label("bytes"))
        .join(_events, _events.c.position == _refs.c.position)
        .where(*scope)
        .group_by(_refs.c.session_id)
        .subquery()
    )
    blob_total = func.coalesce(blob_bytes.c.bytes, 0)
    order = (
        desc(per_session.c.payload_bytes + blob_total) if by_bytes else desc(per_session.c.events)
    )
    query = (
        select(
            per_session.c.session_id,
            _sessions.c.tenant_id,
            per_session.c.events,
            per_session.c.payload_bytes,
            blob_total,
        )
        .join(_sessions, _sessions.c.id == per_session.c.session_id)
        .outerjoin(blob_bytes, blob_bytes.c.session_id == per_session.c.session_id)
        .order_by(order, per_session.c.session_id)
        .limit(top)
    )
    return [
        SessionSize(sid, tenant, int(n), int(_plain(pb)), int(_plain(bb)))
        for sid, tenant, n, pb, bb in conn.execute(query)
    ]


def _usage_sums(engine: Engine, aggregate: Any = func.sum) -> list[ColumnElement[Any]]:
    """Sums of the ``message.usage`` fields, then of its cost (a number or ``cost.total``)."""
    sums = [
        aggregate(_json_number(engine, "message", "usage", name)).label(name)
        for name in _TOKEN_FIELDS
    ]
    cost = aggregate(
        func.coalesce(
            _json_number(engine, "message", "usage", "cost"),
            _json_number(engine, "message", "usage", "cost", "total"),
        ),
    )
    return [*sums, cost]


def _summed(
    conn: Connection, engine: Engine, query: Callable[[Any], Select[Any]]
) -> list[tuple[Any, ...]]:
    """The rows of ``query(func.sum)``; on SQLite, whose sum() fails on integer overflow,
    of ``query(func.total)`` after such a failure (total() adds in floating point and never
    does). Only stored data from before write validation can overflow."""
    try:
        return [tuple(row) for row in conn.execute(query(func.sum))]
    except OperationalError as exc:
        if not is_sqlite(engine) or "overflow" not in str(exc):
            raise
        log.warning("usage sums overflow int64; summing as floats", extra={"error": str(exc)})
        return [
            tuple(int(v) if isinstance(v, float) and v.is_integer() else v for v in row)
            for row in conn.execute(query(func.total))
        ]


def _saturated(values: Sequence[Any], what: str) -> TokenTotals:
    names = (*_TOKEN_FIELDS, "cost")
    return TokenTotals(
        *(saturate(_plain(v), what=f"{what}.{n}") for n, v in zip(names, values, strict=True))
    )


def _token_totals(
    conn: Connection, engine: Engine, scope: Sequence[ColumnElement[bool]]
) -> TokenTotals:
    [row] = _summed(conn, engine, lambda aggregate: _token_sums(engine, scope, aggregate))
    return _saturated(row, "stats.tokens")


def _token_sums(
    engine: Engine, scope: Sequence[ColumnElement[bool]], aggregate: Any
) -> Select[Any]:
    return select(*_usage_sums(engine, aggregate)).where(_events.c.type == "message", *scope)


def _entry_day(engine: Engine) -> ColumnElement[Any]:
    """The day of the entry's own ISO ``timestamp`` (an imported session's events were all
    recorded on the import's day), else the day the journal recorded it."""
    if is_sqlite(engine):
        is_text = func.json_type(_events.c.payload, "$.timestamp") == "text"
        stamp = func.json_extract(_events.c.payload, "$.timestamp")
    else:
        # events.payload is json (exact text), not jsonb: the json_* functions
        is_text = func.json_typeof(func.json_extract_path(_events.c.payload, "timestamp")) == (
            "string"
        )
        stamp = func.json_extract_path_text(_events.c.payload, "timestamp")
    return case((is_text, func.substr(stamp, 1, 10)), else_=_day(engine))


def _usage_by_day(
    conn: Connection, engine: Engine, scope: Sequence[ColumnElement[bool]]
) -> list[DayModelUsage]:
    day = _entry_day(engine).label("day")
    model = _json_text(engine, "message", "model").label("model")
    part = _json_number(engine, "claudeCode", "responseLine")
    responses = func.count(case((func.coalesce(part, 0) == 0, 1)))

    def query(aggregate: Any) -> Select[Any]:
        return (
            select(day, model, responses, *_usage_sums(engine, aggregate))
            .where(
                _events.c.type == "message",
                _json_text(engine, "message", "role") == "assistant",
                *scope,
            )
            .group_by(day, model)
            .order_by(day, model)
        )

    return [
        DayModelUsage(str(d), m, int(_plain(n)), _saturated(values, f"stats.usage.{d}"))
        for d, m, n, *values in _summed(conn, engine, query)
    ]


def _blob_summary(conn: Connection, engine: Engine, tenant_id: str | None) -> BlobSummary:
    """Store-wide, from the blob registry's own stats; per tenant, from its sessions' refs
    only (blobs are shared across tenants, so store-wide totals are not a tenant's to see)."""
    if tenant_id is None:
        registry = BlobIndex(engine).stats()
        references, unique = conn.execute(
            select(func.count(), func.count(func.distinct(_refs.c.hash)))
        ).one()
        return BlobSummary(
            int(references),
            registry.referenced_bytes,
            int(unique),
            registry.referenced_bytes - registry.saved_by_dedup,
        )
    refs = (
        select(_refs.c.hash, _refs.c.size)
        .where(_refs.c.session_id.in_(_tenant_sessions(tenant_id)))
        .subquery()
    )
    references, referenced = conn.execute(
        select(func.count(), func.coalesce(func.sum(refs.c.size), 0))
    ).one()
    hashes = select(refs.c.hash).distinct().subquery()
    unique, unique_bytes = conn.execute(
        select(func.count(), func.coalesce(func.sum(_blobs.c.size), 0)).select_from(
            _blobs.join(hashes, hashes.c.hash == _blobs.c.hash)
        )
    ).one()
    return BlobSummary(
        int(references), int(_plain(referenced)), int(unique), int(_plain(unique_bytes))
    )
