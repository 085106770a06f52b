"""Analysts' figures over the journal: events per type and day, sessions, top sessions,
tokens (and per day and model), blob dedup, artifacts. Every sum is overflow-safe."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal, localcontext
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Select,
    String,
    desc,
    func,
    literal,
    select,
    union_all,
)
from sqlalchemy.exc import OperationalError
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import Subquery

from core.artifacts import stats_by_kind
from core.blobs.store import BlobIndex
from core.db import is_sqlite, snapshot_connection
from core.journal.usage import saturate
from core.maintenance.runs import Progress
from core.query import rollups
from core.query.analytics import (
    _TOKEN_FIELDS,
    _blobs,
    _refs,
    _sessions,
    _tenant_sessions,
)
from core.translate import translated

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
    """Tokens of one model on one day: the date an entry's own ISO ``timestamp`` carries,
    as written (the UTC day for ``…Z``, the producer's local day for ``…-05:00``), the UTC
    day of an epoch-millisecond one, else (no ``timestamp`` that is an entry time, as
    ``core.query.entry_time`` defines it) the UTC day the journal recorded it.

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


@translated
def stats(
    engine: Engine,
    *,
    tenant_id: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    top: int = 10,
    include_inherited: bool = False,
    progress: Progress | None = None,
) -> Stats:
    """Journal stats over events recorded in [since, until); blob and artifact figures are
    current totals (not time-filtered), scoped to the tenant when one is given.

    A fork's copies of its parent's events are left out unless ``include_inherited``: each
    event counts once across a fork tree, in the session that wrote it; with it, every
    session counts all of its events.

    The figures come from the rollup of sealed blocks wholly inside the time range and from
    the live events for the rest (``core.query.rollups``); rolling up what was sealed since
    the last call is done first, best effort (``progress("rollup", done, total)``: blocks).
    """
    top = max(1, min(top, 1000))
    in_tenant = _tenant_sessions(tenant_id) if tenant_id is not None else None
    rollups.roll_up(engine, progress=progress)
    with snapshot_connection(engine) as conn:  # the rollup and the live events, at one time
        the_plan = rollups.plan(conn, since, until)

        def source(by: Sequence[str], sums: Sequence[str], aggregate: Any = func.sum) -> Subquery:
            return rollups.figures(
                engine,
                the_plan,
                since=since,
                until=until,
                sessions=in_tenant,
                by=by,
                sums=sums,
                aggregate=aggregate,
            )

        by_type, by_day, inherited = _counts(
            conn, source(("type", "day", "inherited"), ("events",)), include_inherited
        )
        sessions_query = select(func.count()).select_from(_sessions)
        if tenant_id is not None:
            sessions_query = sessions_query.where(_sessions.c.tenant_id == tenant_id)
        sessions = int(conn.execute(sessions_query).scalar_one())
        per_session = source(("session_id", "inherited"), ("events", "payload_bytes", "blob_bytes"))
        active, by_events, by_bytes = _sessions_figures(conn, per_session, include_inherited, top)
        tokens, usage_by_day = _usage(conn, engine, source, include_inherited)
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


def _counts(
    conn: Connection, src: Subquery, include_inherited: bool
) -> tuple[dict[str, int], list[tuple[str, int]], int]:
    """Events by type and by day (one scan), and the inherited copies in scope."""
    by_type: dict[str, int] = {}
    by_day: dict[str, int] = {}
    inherited = 0
    rows = conn.execute(
        select(src.c.type, src.c.day, src.c.inherited, func.sum(src.c.events)).group_by(
            src.c.type, src.c.day, src.c.inherited
        )
    )
    for kind, day, copied, n in rows:
        count = int(_plain(n))
        if copied:
            inherited += count
            if not include_inherited:
                continue
        by_type[str(kind)] = by_type.get(str(kind), 0) + count
        by_day[str(day)] = by_day.get(str(day), 0) + count
    return dict(sorted(by_type.items())), sorted(by_day.items()), inherited


def _sessions_figures(
    conn: Connection, src: Subquery, include_inherited: bool, top: int
) -> tuple[int, list[SessionSize], list[SessionSize]]:
    """Active sessions and the top ones by events and by bytes, in one statement over the
    per-session sums."""
    per_session = (
        select(
            src.c.session_id.label("session_id"),
            func.sum(src.c.events).label("events"),
            func.sum(src.c.payload_bytes).label("payload_bytes"),
            func.sum(src.c.blob_bytes).label("blob_bytes"),
        )
        .where(*_own(src, include_inherited))
        .group_by(src.c.session_id)
        .cte("per_session")
    )
    total = per_session.c.payload_bytes + per_session.c.blob_bytes

    def top_by(rank: str, order: ColumnElement[Any]) -> Select[Any]:
        ranked = (
            select(
                literal(rank).label("rank"),
                per_session.c.session_id,
                per_session.c.events,
                per_session.c.payload_bytes,
                per_session.c.blob_bytes,
            )
            .order_by(desc(order), per_session.c.session_id)
            .limit(top)
            .subquery()
        )
        return select(ranked)

    count = select(
        literal("count").label("rank"),
        literal(None, String).label("session_id"),
        func.count().label("events"),
        literal(0).label("payload_bytes"),
        literal(0).label("blob_bytes"),
    ).select_from(per_session)
    rows: list[Any] = list(
        conn.execute(
            union_all(count, top_by("events", per_session.c.events), top_by("bytes", total))
        )
    )
    tenants = dict(
        conn.execute(
            select(_sessions.c.id, _sessions.c.tenant_id).where(
                _sessions.c.id.in_([r.session_id for r in rows if r.session_id is not None])
            )
        ).all()
    )
    active = 0
    ranked: dict[str, list[SessionSize]] = {"events": [], "bytes": []}
    for rank, sid, n, pb, bb in rows:
        if rank == "count":
            active = int(n)
        elif sid in tenants:
            size = SessionSize(sid, tenants[sid], int(_plain(n)), int(_plain(pb)), int(_plain(bb)))
            ranked[rank].append(size)
    # a union keeps no order: each list again by its own ranking
    ranked["events"].sort(key=lambda s: (-s.events, s.session_id))
    ranked["bytes"].sort(key=lambda s: (-s.total_bytes, s.session_id))
    return active, ranked["events"], ranked["bytes"]


_TOKENS = rollups.TOKEN_COLUMNS
_USAGE_BY = ("assistant", "entry_day", "model", "has_model", "type", "inherited")


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


def _own(src: Subquery, include_inherited: bool) -> list[ColumnElement[bool]]:
    return [] if include_inherited else [src.c.inherited.is_(False)]


def _usage(
    conn: Connection,
    engine: Engine,
    source: Callable[..., Subquery],
    include_inherited: bool,
) -> tuple[TokenTotals, list[DayModelUsage]]:
    """Token totals over message events, and per entry day and model over assistant
    messages, in one scan."""

    def query(aggregate: Any) -> Select[Any]:
        src = source(_USAGE_BY, ("responses", *_TOKENS), aggregate)
        keys = [src.c.assistant, src.c.entry_day, src.c.model, src.c.has_model]
        return (
            select(*keys, func.sum(src.c.responses), *(aggregate(src.c[n]) for n in _TOKENS))
            .where(src.c.type == "message", *_own(src, include_inherited))
            .group_by(*keys)
        )

    columns: list[list[Any]] = [[] for _ in _TOKENS]
    usage: list[tuple[tuple[str, bool, str], int, list[Any]]] = []
    for assistant, day, model, known, n, *values in _summed(conn, engine, query):
        for column, value in zip(columns, values, strict=True):
            if value is not None:
                column.append(value)
        if assistant:  # a model's rows, then the rows without one (PostgreSQL's NULLS LAST)
            usage.append(((str(day), not known, str(model)), int(_plain(n)), values))
    usage.sort(key=lambda u: u[0])
    return _saturated([_exact_sum(c) for c in columns], "stats.tokens"), [
        DayModelUsage(d, None if unknown else m, n, _saturated(values, f"stats.usage.{d}"))
        for (d, unknown, m), n, values in usage
    ]


def _exact_sum(values: list[Any]) -> Any:
    """The sum of per-group sums as SQL would give it in one: exact for integers and
    PostgreSQL's decimals (whatever the order), correctly rounded for floats."""
    if any(isinstance(v, float) for v in values):
        return math.fsum(float(v) for v in values)
    with localcontext(prec=100):
        return sum(values, start=0)


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
