"""``sessionstore events``, ``stats`` and ``state``: the analysts' commands."""

from __future__ import annotations

import csv
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tasks.cli.common import (
    INT64_MAX,
    JsonOption,
    add_row,
    check_tenant,
    console,
    id_table,
    new_app,
    new_table,
    open_store,
    plain,
    print_json,
    print_table,
)

if TYPE_CHECKING:
    from rich.table import Table

    from core.query.analytics import EventFilter, ListedEvent
    from core.query.preview import Previewer
    from core.records import ManifestEntry
    from core.store import SessionStore

cli = new_app()

PAGE = 1000
DEFAULT_LIMIT = 100
# the table columns before the summary: ids are shown whole (an operator copies them)
_COLUMNS = ("position", "session", "tenant", "seq", "type", "role", "recorded")
CSV_COLUMNS = ("position", "session_id", "tenant_id", "seq", "type", "role", "recorded_at")
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: object) -> object:
    """A text cell a spreadsheet would run as a formula (``=HYPERLINK(…)`` as an event's
    ``type``: OWASP's CSV injection) starts with ``'``, which spreadsheets show as text; the
    ``payload`` column (JSON, always ``{…}``) keeps every value exactly."""
    if isinstance(value, str) and value.startswith(_FORMULA_STARTS):
        return "'" + value
    return value


def _analytics() -> Any:
    from core.query import analytics

    return analytics


class Output(StrEnum):
    table = "table"
    jsonl = "jsonl"
    csv = "csv"


def _when(value: str | None, option: str) -> datetime | None:
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter(
            f"not an ISO 8601 date or time: {value!r}", param_hint=option
        ) from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed


def _summary(event: ListedEvent, previewer: Previewer | None, width: int = 160) -> str:
    """A text preview (blob refs resolved into short previews); with ``--refs``
    (``previewer`` None) the payload as stored, refs whole and long strings cut."""
    from core.query.preview import shorten

    if previewer is not None:
        return shorten(previewer.payload(event.type, event.payload), width)
    from core.query.preview import as_stored

    message = event.payload.get("message")
    shown = message if event.type == "message" and isinstance(message, dict) else event.payload
    return as_stored(shown)


class _Printer:
    """Writes events in one output format, as they come (tables are printed at the end)."""

    def __init__(
        self,
        output: Output,
        *,
        streaming: bool,
        previewer: Previewer | None = None,
        manifest: Callable[[Sequence[int]], dict[int, list[ManifestEntry]]] | None = None,
    ) -> None:
        self.output = output
        self.previewer = previewer
        self.manifest = manifest  # the previewer's: it resolves no ref the manifest lacks
        self.streaming = streaming
        self.table: Table | None = None
        self.csv: Any = None
        if output is Output.csv:
            # RFC 4180 rows end in CRLF: a lone \r in a value is then quoted too (with "\n"
            # as the terminator it was not, and a reader took it for the end of the row)
            self.csv = csv.writer(sys.stdout, lineterminator="\r\n")
            self.csv.writerow((*CSV_COLUMNS, "payload"))
        elif output is Output.table and not streaming:
            self.table = id_table(*_COLUMNS)
            self.table.add_column("summary", min_width=20, max_width=80, overflow="fold")

    def write(self, event: ListedEvent) -> None:

        if self.output is Output.jsonl:
            # exact_json: integers beyond 64 bits are valid payload values (orjson refuses them)
            from core import exact_json

            sys.stdout.write(exact_json.dumps_str(event.to_dict()) + "\n")
        elif self.csv is not None:
            row = event.to_dict()
            from core import exact_json

            cells = (csv_cell(row[c]) for c in CSV_COLUMNS)
            self.csv.writerow((*cells, exact_json.dumps_str(event.payload)))
        elif self.table is not None:
            add_row(self.table, *self._cells(event), _summary(event, self._previewer(event)))
        else:
            line = " ".join(self._cells(event))
            console.print(
                plain(line), plain(_summary(event, self._previewer(event))), soft_wrap=True
            )
        if self.streaming:
            sys.stdout.flush()

    def _previewer(self, event: ListedEvent) -> Previewer | None:
        """The previewer for this event: it resolves the refs its manifest names, no other."""
        if self.previewer is None or self.manifest is None:
            return None
        manifest, position = self.manifest, event.position
        return self.previewer.scoped(
            lambda: {m.hash for m in manifest([position]).get(position, [])}
        )

    @staticmethod
    def _cells(event: ListedEvent) -> list[str]:
        return [
            str(event.position),
            event.session_id,
            event.tenant_id,
            str(event.seq),
            event.type,
            event.role or "",
            event.recorded_at.strftime("%m-%d %H:%M:%S"),
        ]

    def close(self) -> None:
        if self.table is not None:
            print_table(self.table)
        sys.stdout.flush()


@cli.command("events")
def events(
    tenant: str | None = typer.Option(
        None, callback=check_tenant, help="Only this tenant's events."
    ),
    session: str | None = typer.Option(None, help="Only this session's events."),
    types: Annotated[
        list[str] | None, typer.Option("--type", help="Event type (repeatable).")
    ] = None,
    roles: Annotated[
        list[str] | None,
        typer.Option("--role", help="Message role (repeatable): matches message events only."),
    ] = None,
    since: str | None = typer.Option(
        None, help="Entry's own timestamp at or after (ISO 8601; UTC if no zone)."
    ),
    until: str | None = typer.Option(
        None, help="Entry's own timestamp before (ISO 8601; UTC if no zone)."
    ),
    recorded_since: str | None = typer.Option(
        None, "--recorded-since", help="Recorded by the journal at or after (ISO 8601)."
    ),
    recorded_until: str | None = typer.Option(
        None, "--recorded-until", help="Recorded by the journal before (ISO 8601)."
    ),
    refs: bool = typer.Option(
        False, "--refs", help="Show payloads as stored (blob refs), not text previews."
    ),
    after_position: int | None = typer.Option(
        None,
        "--after-position",
        min=0,
        max=INT64_MAX,
        help="Start after this global position (the cursor).",
    ),
    limit: int | None = typer.Option(
        None, min=1, help=f"Most events to print [default: {DEFAULT_LIMIT}; none with --follow]."
    ),
    output: Annotated[Output, typer.Option("--output", "-o", help="Output format.")] = Output.table,
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Keep printing events as they commit, like tail -f."
    ),
    poll_interval: float = typer.Option(
        0.5,
        "--poll-interval",
        min=0.01,
        max=3600,
        help="With --follow: seconds between polls when idle.",
    ),
    timeout: float | None = typer.Option(
        None, min=0, help="With --follow: stop after this many seconds."
    ),
    as_json: bool = JsonOption,
) -> None:
    """List events by global position, filtered; or follow new ones with --follow.

    --since/--until filter on the entry's own timestamp (the payload's "timestamp": epoch ms,
    or ISO 8601 date and time with an optional Z or +hh:mm zone, UTC without; any other value
    matches neither, see the README); --recorded-since/--recorded-until on the time the
    journal recorded it.

    Without --follow, one page is printed and the cursor of the next is shown
    (pass it to --after-position). --follow starts at the current head unless
    --after-position is given, and runs until --limit events, --timeout or Ctrl-C.
    """
    from core.query.analytics import EventFilter

    named = session  # as given: an id, or the agent's own id for the session (external id)
    if session is not None:
        with open_store() as store:
            session = store.resolve_session(session, tenant_id=tenant).id
    flt = EventFilter(
        tenant_id=tenant,
        session_id=session,
        types=tuple(types or ()),
        roles=tuple(roles or ()),
        since=_when(recorded_since, "--recorded-since"),
        until=_when(recorded_until, "--recorded-until"),
        entry_since=_when(since, "--since"),
        entry_until=_when(until, "--until"),
    )
    with open_store() as store:
        previewer = None if refs else _previewer(store)
        if follow:
            out = Output.jsonl if as_json else output
            streamer = _Printer(
                out, streaming=True, previewer=previewer, manifest=store.journal.manifest
            )
            _follow(store, flt, streamer, after_position, limit, poll_interval, timeout, named)
        else:
            printer = (
                None
                if as_json
                else _Printer(
                    output, streaming=False, previewer=previewer, manifest=store.journal.manifest
                )
            )
            _list(store, flt, after_position or 0, limit or DEFAULT_LIMIT, printer)


def _previewer(store: SessionStore) -> Previewer:
    from core.query.preview import for_blobs

    return for_blobs(store.blobs)


def _list(
    store: SessionStore,
    flt: EventFilter,
    after_position: int,
    limit: int,
    printer: _Printer | None,
) -> None:
    """One page, through ``printer``; as one JSON document when it is None (--json)."""
    items: list[ListedEvent] = []
    cursor: str | None = str(after_position)
    remaining = limit
    while cursor is not None and remaining > 0:
        page = _analytics().list_events(
            store.engine, flt, after_position=int(cursor), limit=min(remaining, PAGE)
        )
        for event in page.items:
            if printer is not None:
                printer.write(event)
            else:
                items.append(event)
        remaining -= len(page.items)
        cursor = page.next_cursor
    if printer is None:
        print_json({"items": [e.to_dict() for e in items], "next_cursor": cursor})
        return
    printer.close()
    if cursor is not None:
        typer.echo(f"more: --after-position {cursor}", err=True)


def _follow(
    store: SessionStore,
    flt: EventFilter,
    printer: _Printer,
    after_position: int | None,
    limit: int | None,
    poll_interval: float,
    timeout: float | None,
    named: str | None = None,
) -> None:
    """Print ``flt``'s events as they come. ``named``: the session followed, as given (its
    external id, say), for the line that says it is gone."""
    start = _analytics().head_position(store.engine) if after_position is None else after_position
    deadline = None if timeout is None else time.monotonic() + timeout

    def expired() -> bool:
        return deadline is not None and time.monotonic() >= deadline

    followed = flt.session_id
    gone = False

    def stop() -> bool:
        """Past --timeout; or the session followed is gone (deleted, or moved out of the
        tenant): nothing more can come of it, and a session made again under its external
        id is another one."""
        nonlocal gone
        if expired():
            return True
        gone = followed is not None and not _exists(store, followed, flt.tenant_id)
        return gone

    def nap(seconds: float) -> None:
        time.sleep(
            seconds if deadline is None else max(0.0, min(seconds, deadline - time.monotonic()))
        )

    # The readiness line: every event committed after it is printed (scripts wait for it).
    typer.echo(f"following from position {start}", err=True)
    printed = 0
    stream = _analytics().follow_events(
        store.engine,
        flt,
        after_position=start,
        poll_interval=poll_interval,
        should_stop=stop,
        sleep=nap,
    )
    try:
        for event in stream:
            printer.write(event)
            printed += 1
            if (limit is not None and printed >= limit) or expired():
                break
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a follow normally ends
    finally:
        printer.close()
    if gone and followed is not None:
        from core.errors import SessionNotFound

        shown = followed if named in (None, followed) else f"{named} ({followed})"
        raise SessionNotFound(followed, f"session not found: {shown}")


def _exists(store: SessionStore, session_id: str, tenant_id: str | None) -> bool:
    """The session is there, in the tenant given (moved to another, it is not)."""
    from core.errors import SessionNotFound

    try:
        store.journal.get_session(session_id, tenant_id=tenant_id)
    except SessionNotFound:
        return False
    return True


# stats ----------------------------------------------------------------------------------


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def _pairs_table(title: str, rows: Iterable[tuple[str, str]], *headers: str) -> Table:
    table = new_table(*headers, title=title, title_justify="left")
    for row in rows:
        add_row(table, *row)  # plain text: "[image 3 KB]" is not markup
    return table


@cli.command("stats")
def stats(
    tenant: str | None = typer.Option(None, callback=check_tenant, help="Only this tenant."),
    since: str | None = typer.Option(None, help="Events recorded at or after (ISO 8601)."),
    until: str | None = typer.Option(None, help="Events recorded before (ISO 8601)."),
    top: int = typer.Option(10, min=1, max=1000, help="How many top sessions to list."),
    include_inherited: bool = typer.Option(
        False,
        "--include-inherited",
        help="Count the events a fork copied from its parent in every session that holds "
        "them (default: each event once, in the session that wrote it).",
    ),
    as_json: bool = JsonOption,
) -> None:
    """Events per type and per day, sessions, top sessions, tokens, blob dedup, artifacts."""
    from tasks.cli.maintenance import _bars

    with open_store() as store, _bars(True) as bars:
        result = store.stats(
            tenant_id=tenant,
            since=_when(since, "--since"),
            until=_when(until, "--until"),
            top=top,
            include_inherited=include_inherited,
            progress=bars,
        )
    data = result.to_dict()
    if as_json:
        print_json(data)
        return
    tokens, blobs, artifacts = data["tokens"], data["blobs"], data["artifacts"]
    ratio = blobs["dedup_ratio"]
    console.print(
        _pairs_table(
            "Summary",
            [
                ("events", f"{data['events']:,}"),
                (
                    "inherited by forks",
                    f"{data['inherited_events']:,} "
                    + ("(counted)" if include_inherited else "(not counted)"),
                ),
                ("sessions", f"{data['sessions']:,} ({data['active_sessions']:,} with events)"),
                ("tokens in / out", f"{tokens['input']:,} / {tokens['output']:,}"),
                ("cache read / write", f"{tokens['cache_read']:,} / {tokens['cache_write']:,}"),
                ("total tokens", f"{tokens['total_tokens']:,}"),
                ("cost", f"{tokens['cost']:,.4f}"),
                ("blob refs", f"{blobs['references']:,} -> {blobs['unique_blobs']:,} blobs"),
                ("blob dedup ratio", f"{ratio:.2f}x" if ratio else "n/a"),
                ("artifact bytes", f"{_bytes(artifacts['bytes'])} in {artifacts['count']:,}"),
            ],
            "",
            "",
        )
    )
    console.print(
        _pairs_table(
            "Events per type",
            ((t, f"{n:,}") for t, n in data["events_by_type"].items()),
            "type",
            "events",
        )
    )
    console.print(
        _pairs_table(
            "Events per day (UTC)",
            ((d["day"], f"{d['events']:,}") for d in data["events_by_day"]),
            "day",
            "events",
        )
    )
    from rich.table import Column, Table

    usage = Table(
        Column("day", no_wrap=True),
        Column("model", overflow="fold"),
        "responses",
        "in",
        "out",
        "cache r/w",
        "total",
        title="Tokens per day (UTC, entry time) and model",
    )
    usage.title_justify = "left"
    for u in data["usage_by_day"]:
        add_row(
            usage,
            u["day"],
            u["model"] or "?",
            f"{u['responses']:,}",
            f"{u['input']:,}",
            f"{u['output']:,}",
            f"{u['cache_read']:,} / {u['cache_write']:,}",
            f"{u['total_tokens']:,}",
        )
    console.print(usage)
    for key, title in (
        ("top_sessions_by_events", "Top sessions by events"),
        ("top_sessions_by_bytes", "Top sessions by bytes"),
    ):
        table = id_table("session", "tenant", title=title, title_justify="left")
        for name in ("events", "payload", "blobs"):
            table.add_column(name)
        for s in data[key]:
            add_row(
                table,
                s["session_id"],
                s["tenant_id"],
                f"{s['events']:,}",
                _bytes(s["payload_bytes"]),
                _bytes(s["blob_bytes"]),
            )
        print_table(table)


# state ----------------------------------------------------------------------------------


@cli.command("state")
def state(
    session_id: str,
    at_seq: int | None = typer.Option(
        None, "--at-seq", min=0, max=INT64_MAX, help="State after this seq."
    ),
    tenant: str | None = typer.Option(
        None, callback=check_tenant, help="Fail unless the session is this tenant's."
    ),
    messages: int | None = typer.Option(
        None,
        min=0,
        max=INT64_MAX,
        show_default=False,
        help="How many of the last messages to show [default: 10; with --json, all].",
    ),
    refs: bool = typer.Option(
        False, "--refs", help="Show messages as stored (blob refs), not text previews."
    ),
    as_json: bool = JsonOption,
) -> None:
    """A session's state rebuilt from its journal (snapshot + fold).

    Messages show as text previews (tool calls by name, images as [image N KB], the first
    characters of stored text); --refs shows them as stored, blob refs and all, as --json
    always does. --json gives every message of the context unless --messages says how many.
    """
    with open_store() as store:
        session_id = store.resolve_session(session_id, tenant_id=tenant).id
        result = store.state(session_id, at_seq=at_seq, tenant_id=tenant, rehydrate=False)
        previewer = None
        if not refs:  # the refs this session's manifest names, and no other
            previewer = _previewer(store).scoped(lambda: store.journal.blob_hashes(session_id))
        rows = [
            (str(m.seq), m.role, _message_text(m.data, previewer))
            for m in _tail(result.messages, 10 if messages is None else messages)
        ]
    if as_json:
        shown = result.to_dict()
        if messages is not None:  # the last N, as in the table; "context messages" stays
            shown["messages"] = list(_tail(shown["messages"], messages))
        print_json(shown)
        return
    info, counters = result.info, result.counters
    model = info.model
    console.print(
        _pairs_table(
            f"Session {result.session_id} at seq {result.seq}",
            [
                ("tenant", result.tenant_id),
                ("title", info.title or ""),
                ("cwd", info.cwd or ""),
                ("model", _model_name(model.provider, model.model_id) if model else ""),
                ("thinking level", info.thinking_level or ""),
                ("entries / branch", f"{len(result.tree):,} / {len(result.branch):,}"),
                ("leaf", result.leaf_id or ""),
                ("context messages", f"{len(result.messages):,}"),
                ("events", f"{counters.events:,}"),
                ("messages by role", ", ".join(f"{k}={v}" for k, v in counters.by_role.items())),
                ("tool calls", f"{counters.tool_calls:,} ({counters.tool_errors:,} errors)"),
                ("tokens", f"{counters.usage.total_tokens:,} (cost {counters.usage.cost:,.4f})"),
                ("artifacts", f"{len(result.artifacts):,}"),
            ],
            "",
            "",
        )
    )
    table = new_table("seq", "role", title="Last messages", title_justify="left")
    table.add_column("text", overflow="fold")  # --refs: a ref is folded, never cut
    for row in rows:
        add_row(table, *row)  # plain text: "[image 3 KB]" is not markup
    console.print(table)


def _message_text(data: dict[str, Any], previewer: Previewer | None) -> str:
    from core.query.preview import shorten

    if previewer is not None:
        return shorten(previewer.message(data), 200)
    from core.query.preview import as_stored

    return as_stored(data.get("content", data))


def _tail(items: list[Any], n: int) -> Iterator[Any]:
    yield from items[len(items) - n :] if n else ()


def _model_name(provider: str | None, model_id: str | None) -> str:
    """``provider/model``, or what of the two the session names (never ``None/...``)."""
    return "/".join(part for part in (provider, model_id) if part)
