"""Where a time-bounded listing can start: an upper bound of ``recorded_at`` per sealed block
of positions (table ``event_time_blocks``, migration 0013).

``events --since T`` lists events by position whose ``recorded_at >= T``. No index serves
both the filter and the order, so PostgreSQL walked the journal from position 1 to the first
match (a read proportional to the journal) or sorted every match. ``recorded_at`` is nearly
monotone in position (an append's clock is read just before it takes the writers' lock; a
fork's copied rows carry the fork's time), but not exactly, so a bound on position cannot be
derived from a time by a lookup alone. The summary gives one: the first block whose bound
reaches ``T`` holds the first match or comes before it.

Exactness:

- A block is summarized only when sealed: the head is past its last position, and positions
  commit in order (invariant 4), so no row can appear in it later.
- ``recorded_at`` is never updated, and a deleted row leaves its block's bound too high,
  never too low: the start is never past a match.
- Blocks not yet summarized count as matching: the listing then starts no later than the
  first of them. So a reader without write access (an analyst's role) stays correct; it only
  scans more.

Readers fill the summary as they need it, for the sealed blocks past the last one summarized:
the first time-bounded listing after a bulk load reads the journal once; later ones read
only what was appended since. Nothing is added to the append path.
"""

from __future__ import annotations

import logging
import weakref
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Engine, cast, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.sql.elements import ColumnElement

from core.db import is_sqlite, read_connection, write_transaction
from core.models import EventRow, EventTimeBlockRow, table_of
from core.query.entry_time import bound_us, entry_us

log = logging.getLogger(__name__)

TIME_BLOCK = 4096  # positions per block: ~250 summary rows per million events

_events = table_of(EventRow)
_blocks = table_of(EventTimeBlockRow)
_failures: weakref.WeakKeyDictionary[Engine, int] = weakref.WeakKeyDictionary()


def first_position_at_or_after(
    engine: Engine, *, recorded: datetime | None = None, entry: datetime | None = None
) -> int:
    """A position no later than the first event recorded at or after ``recorded`` and whose
    entry time is at or after ``entry`` (1 when nothing better is known)."""
    if recorded is None and entry is None:
        return 1
    summarize(engine)
    bounds = []
    if recorded is not None:
        bounds.append(_blocks.c.max_recorded_at >= recorded)
    if entry is not None:
        bounds.append(_blocks.c.max_entry_ms >= -(-bound_us(entry) // 1000))  # ms, rounded up
    with read_connection(engine) as conn:
        first = conn.execute(select(func.min(_blocks.c.block)).where(*bounds)).scalar_one_or_none()
        last = conn.execute(select(func.max(_blocks.c.block))).scalar_one_or_none()
    if last is None:
        return 1
    # Blocks past ``last`` are not summarized: they count as matching.
    block = int(first) if first is not None else int(last) + 1
    return max(1, block * TIME_BLOCK)


def summarize(engine: Engine) -> int:
    """Summarize the sealed blocks past the last summarized one; how many rows were added.
    Best effort: a reader that may not write (or a busy SQLite) leaves it for later."""
    try:
        with read_connection(engine) as conn:
            last = conn.execute(select(func.max(_blocks.c.block))).scalar_one_or_none()
            head = conn.execute(select(func.max(_events.c.position))).scalar_one_or_none()
        if head is None:
            return 0
        start = 0 if last is None else (int(last) + 1) * TIME_BLOCK
        end = (int(head) + 1) // TIME_BLOCK * TIME_BLOCK  # first position past the sealed ones
        if end <= start:
            return 0
        block = _events.c.position // TIME_BLOCK  # integer division on both backends
        rows = (
            select(block.label("block"), func.max(_events.c.recorded_at), _entry_bound(engine))
            .where(_events.c.position >= start, _events.c.position < end)
            .group_by(block)
        )
        insert_ = sqlite_insert if is_sqlite(engine) else pg_insert
        statement = (
            insert_(_blocks)
            .from_select(["block", "max_recorded_at", "max_entry_ms"], rows)
            .on_conflict_do_nothing(index_elements=[_blocks.c.block])
            .returning(_blocks.c.block)
        )
        with write_transaction(engine) as conn:
            # the rows returned, not rowcount: PostgreSQL's driver reported -1 for this
            # INSERT ... SELECT through SQLAlchemy
            added = len(conn.execute(statement).all())
    except SQLAlchemyError as exc:
        _failed(engine, exc)
        return 0
    _failures.pop(engine, None)
    return added


def _failed(engine: Engine, exc: SQLAlchemyError) -> None:
    """Once is a busy SQLite or a lost connection (DEBUG); again at the next listing, it is
    likely to stay (a role that may not write the summary, a query that cannot run) and
    every time-bounded listing scans from further back than it needs to: WARNING."""
    count = _failures.get(engine, 0) + 1
    _failures[engine] = count
    level = logging.DEBUG if count == 1 else logging.WARNING
    log.log(
        level,
        "event time blocks not summarized (%d times in a row): %s",
        count,
        exc,
        extra={"failures": count, "error": type(exc).__name__},
    )


def _entry_bound(engine: Engine) -> ColumnElement[Any]:
    """Above the block's largest entry time (``core.query.entry_time``: microseconds within
    the years 1-9999), in milliseconds: never below it, as the division truncates toward
    zero. NULL when no event of the block has one."""
    return cast(func.max(entry_us(engine)), BigInteger) // 1000 + 1
