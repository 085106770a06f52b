"""Stats that do not read the journal: the events of each session and recorded day, grouped
by type and (for assistant messages) entry day and model, with their counts, bytes and
``message.usage`` sums (tables ``event_rollups`` and ``event_rollup_blocks``, migration 0014).

``stats()`` used to aggregate every event on every call: counts by type and day, the top
sessions by events and bytes, and the tokens of every assistant message parsed from its
JSON, about 35 s at a million events. It now reads the rollup for the days that lie wholly
inside its ``[since, until)``, and the live events for the rest: those of the (at most two)
days a bound cuts, found by the ``recorded_at`` index, and those not rolled up yet.

What is rolled up is a set of sealed blocks of positions (``TIME_BLOCK`` positions each):

- A block is rolled up only when sealed (the head is past its last position; positions
  commit in order, invariant 4), in one transaction that first claims the block's marker
  row (``ON CONFLICT DO NOTHING ... RETURNING``) and then adds its events' figures to the
  rollup rows (an upsert per key). Two readers never count one block twice, and a failed
  roll-up leaves neither the claim nor any figures.
- The rolled-up blocks are always a prefix of the journal, ``[0, rolled_end)``, except blocks
  marked ``rolled = false``: on SQLite an integer sum can overflow (only data stored before
  write validation can); such a block is read live, where the overflow falls back to
  floating-point sums as before.
- Events are never updated. They are deleted only with their session, in the transaction
  that deletes the session's rollup rows too; a roll-up racing that delete can still add
  rows for it, so readers count only rows whose session exists. A move changes the
  session's tenant, which readers take from ``sessions``.
- A reader reads the markers, the rollup and the live events in one snapshot
  (``snapshot_connection``): a roll-up that commits meanwhile is invisible to it as a whole,
  markers and figures alike, so no event is counted twice or missed.

Readers fill it as they need it, a few blocks per transaction (a bounded hold of SQLite's
write lock); a reader that may not write (an analyst's role) stays exact and reads more
live. Nothing is added to the append path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    Numeric,
    Select,
    String,
    Text,
    and_,
    case,
    cast,
    false,
    func,
    literal,
    null,
    or_,
    select,
    true,
    union_all,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import OperationalError, ProgrammingError, SQLAlchemyError
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import Subquery

from core.db import advisory_lock, is_sqlite, read_connection, write_transaction
from core.maintenance.runs import Progress
from core.models import (
    ROLLUP_KEY,
    ROLLUP_LOCK,
    EventRollupBlockRow,
    EventRollupRow,
    as_utc,
    table_of,
)
from core.query.analytics import (
    _TOKEN_FIELDS,
    _day,
    _events,
    _json_number,
    _json_text,
    _payload_bytes,
    _refs,
    _sessions,
)
from core.query.entry_time import entry_day

log = logging.getLogger(__name__)

TIME_BLOCK = 256
"""Positions per rolled-up block. What is not rolled up yet (under a block, past the last
sealed one) is read live by every ``stats()`` call, JSON and all, so smaller is cheaper."""
ROLLUP_CHUNK_BLOCKS = 64  # blocks per roll-up transaction: ~16k events
MODEL_CHARS = 200
"""Model names are grouped (and reported) by their first 200 characters: the rollup's key
is one index entry, which PostgreSQL caps at ~2.7 kB."""

_rollups = table_of(EventRollupRow)
_marks = table_of(EventRollupBlockRow)

TOKEN_COLUMNS = ("input", "output", "cache_read", "cache_write", "total_tokens", "cost")
"""The rollup's token columns: ``message.usage`` fields in ``_TOKEN_FIELDS`` order, then
the cost (a number or ``cost.total``)."""

KEY_COLUMNS = ROLLUP_KEY
SUM_COLUMNS = ("events", "payload_bytes", "blob_bytes", "responses", *TOKEN_COLUMNS)


# rolling up --------------------------------------------------------------------------------


def roll_up(
    engine: Engine, *, max_blocks: int | None = None, progress: Progress | None = None
) -> int:
    """Roll up the sealed blocks past the last claimed one (at most ``max_blocks``); how
    many blocks were claimed. Best effort: a reader that may not write, or a busy SQLite,
    leaves the rest for later. ``progress("rollup", blocks done, blocks to do)`` after each
    transaction."""
    try:
        with read_connection(engine) as conn:
            last = conn.execute(select(func.max(_marks.c.block))).scalar_one_or_none()
            head = conn.execute(select(func.max(_events.c.position))).scalar_one_or_none()
    except SQLAlchemyError as exc:
        log.debug("event rollups not read: %s", exc)
        return 0
    if head is None:
        return 0
    first = 0 if last is None else int(last) + 1
    end = (int(head) + 1) // TIME_BLOCK  # the first block not sealed
    if max_blocks is not None:
        end = min(end, first + max_blocks)
    done = 0
    for lo in range(first, end, ROLLUP_CHUNK_BLOCKS):
        if progress is not None:
            progress("rollup", lo - first, end - first)
        try:
            done += _roll_up_chunk(engine, lo, min(lo + ROLLUP_CHUNK_BLOCKS, end))
        except SQLAlchemyError as exc:
            log.debug("event rollups stopped at block %d: %s", lo, exc)
            return done
    if progress is not None and end > first:
        progress("rollup", end - first, end - first)
    return done


def _roll_up_chunk(engine: Engine, lo: int, hi: int) -> int:
    """Blocks [lo, hi) in one transaction; on SQLite's integer overflow, one at a time."""
    try:
        return _roll_up_blocks(engine, lo, hi)
    except OperationalError as exc:
        if not (is_sqlite(engine) and "overflow" in str(exc)):
            raise
    return sum(_roll_up_one_by_one(engine, block) for block in range(lo, hi))


def _roll_up_one_by_one(engine: Engine, block: int) -> int:
    try:
        return _roll_up_blocks(engine, block, block + 1)
    except OperationalError as exc:
        if "overflow" not in str(exc):
            raise
        log.warning(
            "usage sums of block %d overflow int64; it is read live", block, extra={"block": block}
        )
        return _roll_up_blocks(engine, block, block + 1, rolled=False)


def _roll_up_blocks(engine: Engine, lo: int, hi: int, *, rolled: bool = True) -> int:
    """Claim the markers of blocks [lo, hi) and add the claimed blocks' figures to the
    rollup, in one transaction; how many were claimed. Every block gets a marker, empty or
    not, so the claimed blocks are always a prefix of the journal."""
    insert_ = sqlite_insert if is_sqlite(engine) else pg_insert
    claim = (
        insert_(_marks)
        .values([{"block": block, "rolled": rolled} for block in range(lo, hi)])
        .on_conflict_do_nothing(index_elements=[_marks.c.block])
        .returning(_marks.c.block)
    )
    with write_transaction(engine) as conn:
        advisory_lock(conn, ROLLUP_LOCK, shared=True)  # no session delete meanwhile
        claimed = sorted(int(b) for b in conn.execute(claim).scalars())
        if claimed and rolled:
            for a, b in _runs(claimed):
                conn.execute(_upsert(engine, a * TIME_BLOCK, b * TIME_BLOCK))
    return len(claimed)


def _upsert(engine: Engine, start: int, end: int) -> Any:
    """Add the figures of positions [start, end) to the rollup rows of their keys."""
    rows = _grouped(engine, [(start, end)], scope=[])
    insert_ = sqlite_insert if is_sqlite(engine) else pg_insert
    statement = insert_(_rollups).from_select([*KEY_COLUMNS, *SUM_COLUMNS], rows)
    new = statement.excluded
    added: dict[str, Any] = {
        name: _rollups.c[name] + new[name] for name in ("events", "payload_bytes", "blob_bytes")
    }
    added["responses"] = _rollups.c.responses + new.responses
    for name in TOKEN_COLUMNS:  # NULL: no such number in any event of the key
        added[name] = func.coalesce(_rollups.c[name] + new[name], _rollups.c[name], new[name])
    return statement.on_conflict_do_update(
        index_elements=[_rollups.c[name] for name in KEY_COLUMNS], set_=added
    )


def _runs(blocks: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted block numbers as half-open runs of consecutive blocks."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs


# the grouped events, live ------------------------------------------------------------------


def _in_ranges(position: Any, ranges: Sequence[tuple[int, int | None]]) -> ColumnElement[bool]:
    return or_(
        *(
            and_(position >= lo, position < hi) if hi is not None else position >= lo
            for lo, hi in ranges
        )
    )


def _grouped(
    engine: Engine,
    ranges: Sequence[tuple[int, int | None]],
    *,
    scope: Sequence[ColumnElement[bool]],
    aggregate: Any = func.sum,
    tokens: bool = True,
) -> Select[Any]:
    """Events in the position ranges ``[lo, hi)`` (``hi`` None: no end) and ``scope``,
    grouped by the rollup's key, with the rollup's sums, in its column order. Without
    ``tokens`` the usage columns are constants, and the JSON is not read."""
    blob_bytes = (
        select(_refs.c.position.label("position"), func.sum(_refs.c.size).label("bytes"))
        .where(_in_ranges(_refs.c.position, ranges))
        .group_by(_refs.c.position)
        .subquery()
    )
    keys, (count, payload_bytes, *rest), grouping = _row_columns(engine, aggregate, tokens)
    sums = [count, payload_bytes, func.coalesce(func.sum(blob_bytes.c.bytes), 0), *rest]
    names = [*KEY_COLUMNS, *SUM_COLUMNS]
    return (
        select(*(c.label(n) for c, n in zip([*keys, *sums], names, strict=True)))
        .select_from(_events.outerjoin(blob_bytes, blob_bytes.c.position == _events.c.position))
        .where(_in_ranges(_events.c.position, ranges), *scope)
        .group_by(*grouping)
    )


# (dialect, aggregate, tokens) -> the live part's key and sum columns but blob bytes, and
# its grouping: the same expressions every time, built once (a stats() call builds
# several parts; building their JSON expressions took most of a small journal's call)
_COLUMNS: dict[tuple[str, str, bool], tuple[list[Any], list[Any], list[Any]]] = {}


def _row_columns(
    engine: Engine, aggregate: Any, tokens: bool
) -> tuple[list[Any], list[Any], list[Any]]:
    key = (engine.dialect.name, aggregate(literal(0)).name, tokens)
    if key not in _COLUMNS:
        _COLUMNS[key] = _build_row_columns(engine, aggregate, tokens)
    return _COLUMNS[key]


def _build_row_columns(
    engine: Engine, aggregate: Any, tokens: bool
) -> tuple[list[Any], list[Any], list[Any]]:
    """See ``_grouped``: its keys; its sums, with no blob bytes between the payload bytes
    and the responses; its grouping."""
    is_message = _events.c.type == "message"
    assistant = and_(is_message, _json_text(engine, "message", "role") == "assistant")
    raw_model = _json_text(engine, "message", "model")
    model = case((assistant, func.substr(cast(raw_model, Text), 1, MODEL_CHARS)), else_="")
    has_model = case((and_(assistant, raw_model.is_not(None)), true()), else_=false())
    day_of_entry = case((assistant, cast(entry_day(engine, _day(engine)), Text)), else_="")
    part = _json_number(engine, "claudeCode", "responseLine")
    responses = func.count(case((and_(assistant, func.coalesce(part, 0) == 0), 1)))
    usage = [_json_number(engine, "message", "usage", name) for name in _TOKEN_FIELDS]
    cost = func.coalesce(
        _json_number(engine, "message", "usage", "cost"),
        _json_number(engine, "message", "usage", "cost", "total"),
    )
    sums_of_tokens: list[ColumnElement[Any]] = [
        aggregate(case((is_message, value))) if tokens else cast(null(), Numeric)
        for value in (*usage, cost)
    ]
    keys: list[ColumnElement[Any]] = [
        cast(_day(engine), String),
        _events.c.session_id,
        _events.c.type,
        func.coalesce(day_of_entry, ""),
        func.coalesce(model, ""),
        has_model,
        case((assistant, true()), else_=false()),
        _events.c.inherited,
    ]
    sums: list[ColumnElement[Any]] = [
        func.count(),
        func.coalesce(func.sum(_payload_bytes(engine)), 0),
        responses,
        *sums_of_tokens,
    ]
    grouping = keys
    if not tokens:  # the usage keys too: figures by type, day and session read no JSON
        keys = [*keys[:3], literal("", Text), literal("", Text), false(), false(), keys[7]]
        grouping = [keys[0], keys[1], keys[2], keys[7]]
        sums[2] = literal(0, BigInteger)  # responses
    return keys, sums, grouping


# reading -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    """What a reader takes from the rollup and what it reads live.

    ``rolled_end``: positions below it are rolled up, except ``unrolled`` (block ranges
    marked ``rolled = false``). ``days``: the rollup's days to read, ``[first, end)`` as
    ``YYYY-MM-DD`` strings (None: unbounded); None when no day lies wholly in the range.
    ``cut``: the ``recorded_at`` ranges read live below ``rolled_end``, the parts of the
    time range outside those days."""

    rolled_end: int
    unrolled: list[tuple[int, int]]
    days: tuple[str | None, str | None] | None
    cut: list[tuple[datetime | None, datetime | None]]


def _day_start(when: datetime) -> datetime:
    when = as_utc(when)
    return datetime(when.year, when.month, when.day, tzinfo=UTC)


def plan(conn: Connection, since: datetime | None, until: datetime | None) -> Plan:
    """Split ``[since, until)`` into whole UTC days (from the rollup) and the cut parts.
    A reader that may not read the rollup's tables reads everything live."""
    for bound in (since, until):
        if bound is not None and bound.tzinfo is None:
            raise ValueError("naive datetime: sessionstore stores UTC-aware datetimes only")
    try:
        with conn.begin_nested():  # a savepoint: a refused read leaves the snapshot usable
            return _plan(conn, since, until)
    except ProgrammingError as exc:  # e.g. a role granted SELECT before migration 0014
        log.debug("event rollups not readable; stats read every event: %s", exc)
        return Plan(0, [], None, [])


def _plan(conn: Connection, since: datetime | None, until: datetime | None) -> Plan:
    last = conn.execute(select(func.max(_marks.c.block))).scalar_one_or_none()
    rolled_end = 0 if last is None else (int(last) + 1) * TIME_BLOCK
    skipped = select(_marks.c.block).where(_marks.c.rolled.is_(False)).order_by(_marks.c.block)
    unrolled = _runs([int(b) for b in conn.execute(skipped).scalars()])
    first: datetime | None = None
    if since is not None:
        first = _day_start(since)
        if first < since:
            try:
                first += timedelta(days=1)
            except OverflowError:  # since is in the last day a datetime can name
                return Plan(rolled_end, unrolled, None, [(since, until)])
    end = None if until is None else _day_start(until)
    if first is not None and end is not None and first >= end:  # no whole day
        return Plan(rolled_end, unrolled, None, [(since, until)])
    cut: list[tuple[datetime | None, datetime | None]] = []
    if since is not None and first is not None and since < first:
        cut.append((since, first))
    if until is not None and end is not None and end < until:
        cut.append((end, until))
    days = (
        None if first is None else first.date().isoformat(),  # years < 1000 padded too
        None if end is None else end.date().isoformat(),
    )
    return Plan(rolled_end, unrolled, days, cut)


def figures(
    engine: Engine,
    the_plan: Plan,
    *,
    since: datetime | None,
    until: datetime | None,
    sessions: Select[Any] | None,
    by: Sequence[str],
    sums: Sequence[str],
    aggregate: Any = func.sum,
) -> Subquery:
    """The journal's figures over ``[since, until)``: the ``sums`` (of ``SUM_COLUMNS``)
    grouped ``by`` some of the rollup's key columns, per part: the rollup rows of the whole
    days, live groups for the cut parts and for what is not rolled up. A part's rows are
    grouped by ``by`` within the part, so a reader that groups them again reads a few rows
    per part, not one per rollup row: with every session active on every day the rollup
    has nearly a row per event. ``sessions``: the session ids in scope (a tenant's), else
    every existing session. ``aggregate`` sums the tokens (SQLite's ``total`` after an
    integer overflow). Without a usage column in ``by`` or ``sums`` the live rows leave
    the usage columns (entry day, model, assistant, responses, tokens) empty and the JSON
    is not read."""
    usage = {"entry_day", "model", "has_model", "assistant", "responses", *TOKEN_COLUMNS}
    tokens = not usage.isdisjoint({*by, *sums})
    in_tenant: list[ColumnElement[bool]] = []
    if sessions is not None:
        in_tenant.append(_events.c.session_id.in_(sessions))
    bounds: list[ColumnElement[bool]] = []
    if since is not None:
        bounds.append(_events.c.recorded_at >= since)
    if until is not None:
        bounds.append(_events.c.recorded_at < until)
    unrolled = [(a * TIME_BLOCK, b * TIME_BLOCK) for a, b in the_plan.unrolled]
    live = [*unrolled, (the_plan.rolled_end, None)]

    def part(ranges: Sequence[tuple[int, int | None]], *where: ColumnElement[bool]) -> Select[Any]:
        return _grouped(
            engine, ranges, scope=[*in_tenant, *where], aggregate=aggregate, tokens=tokens
        )

    parts = [part(live, *bounds)]
    rolled = [(0, the_plan.rolled_end)]
    not_unrolled = [~_in_ranges(_events.c.position, unrolled)] if unrolled else []
    for lo, hi in the_plan.cut if the_plan.rolled_end else []:
        cut: list[ColumnElement[bool]] = [_events.c.recorded_at >= lo] if lo is not None else []
        cut += [_events.c.recorded_at < hi] if hi is not None else []
        parts.append(part(rolled, *cut, *not_unrolled))
    if the_plan.days is not None and the_plan.rolled_end:
        first, end = the_plan.days
        in_scope = sessions if sessions is not None else select(_sessions.c.id)
        where: list[ColumnElement[bool]] = [_rollups.c.session_id.in_(in_scope)]
        where += [_rollups.c.day >= first] if first is not None else []
        where += [_rollups.c.day < end] if end is not None else []
        columns = [_rollups.c[name] for name in (*KEY_COLUMNS, *SUM_COLUMNS)]
        parts.append(select(*columns).where(*where))
    grouped = [_regrouped(p, by, sums, aggregate) for p in parts]
    if len(grouped) == 1:
        return grouped[0].subquery("figures")
    return union_all(*grouped).subquery("figures")


def _regrouped(
    part: Select[Any], by: Sequence[str], sums: Sequence[str], aggregate: Any
) -> Select[Any]:
    rows = part.subquery()
    keys = [rows.c[name] for name in by]
    totals = [
        (aggregate if name in TOKEN_COLUMNS else func.sum)(rows.c[name]).label(name)
        for name in sums
    ]
    return select(*keys, *totals).group_by(*keys)
