"""``sessionstore append`` and ``sessionstore dead-letters``."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from core.errors import InvalidEvent
from tasks.cli.common import (
    JsonOption,
    TenantOption,
    add_row,
    confirm,
    console,
    err_console,
    id_table,
    new_app,
    open_store,
    plain,
    print_fields,
    print_json,
    print_table,
    queue_app,
)

if TYPE_CHECKING:
    from core.records import AppendResult

cli = new_app()

dead_app = new_app(help="Rejected queued writes: list, show, export, replay, discard.")
cli.add_typer(dead_app, name="dead-letters")


def _read_jsonl(stream: Iterable[str], source: str) -> Iterator[tuple[int, Any]]:
    """(line number, event) for each non-blank line; a bad line names its number."""
    for number, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidEvent("", f"{source} line {number}: not valid JSON ({exc.msg})") from None


def _batches(lines: Iterator[tuple[int, Any]], size: int) -> Iterator[tuple[list[int], list[Any]]]:
    numbers: list[int] = []
    events: list[Any] = []
    for number, event in lines:
        numbers.append(number)
        events.append(event)
        if len(events) == size:
            yield numbers, events
            numbers, events = [], []
    if events:
        yield numbers, events


def _with_line(exc: InvalidEvent, numbers: list[int], source: str) -> InvalidEvent:
    if exc.index is None or exc.index >= len(numbers):
        return exc
    return InvalidEvent(exc.field, f"{source} line {numbers[exc.index]}: {exc.reason}")


@cli.command("append")
def append(
    session_id: str = typer.Argument(..., help="The session to append to."),
    source: str = typer.Argument("-", help="A JSONL file of events, or - for stdin."),
    enqueue: bool = typer.Option(False, "--enqueue", help="Go through the queue (a worker)."),
    key: str | None = typer.Option(None, help="Idempotency key (per batch: KEY:N)."),
    expected_seq: int | None = typer.Option(None, help="Fail unless the head is this seq."),
    batch_size: int = typer.Option(100, min=1, help="Events per write."),
    tenant: str | None = TenantOption,
    as_json: bool = JsonOption,
) -> None:
    """Append events from a JSONL file or stdin, one write per batch."""
    with ExitStack() as stack:
        stream = sys.stdin if source == "-" else stack.enter_context(Path(source).open())
        store = stack.enter_context(open_store(create=True))
        # before anything is read or sent: an unknown session is not found here (exit 4), as
        # on the direct path, not a dead letter the queue makes of every batch
        session_id = store.resolve_session(session_id, tenant_id=tenant).id
        name = "stdin" if source == "-" else source
        writer = _queue_writer(stack) if enqueue else store.append
        results: list[AppendResult] = []
        expected = expected_seq
        for n, (numbers, events) in enumerate(_batches(_read_jsonl(stream, name), batch_size)):
            try:
                result = writer(
                    session_id,
                    events,
                    expected_seq=expected,
                    idempotency_key=f"{key}:{n}" if key else None,
                )
            except InvalidEvent as exc:
                raise _with_line(exc, numbers, name) from None
            results.append(result)
            expected = result.last_seq if expected is not None else None
    _report(results, as_json)


def _queue_writer(stack: ExitStack) -> Any:
    from tasks.producer import enqueue_append

    celery_app = queue_app(stack)

    def write(session_id: str, events: list[Any], **options: Any) -> AppendResult:
        return enqueue_append(session_id, events, app=celery_app, **options).get(timeout=120)

    return write


def _report(results: list[AppendResult], as_json: bool) -> None:
    if as_json:
        print_json([r.to_dict() for r in results])
        return
    if not results:
        console.print("no events in the input")
        return
    count = sum(r.last_seq - r.first_seq + 1 for r in results)
    replayed = sum(1 for r in results if r.replayed)
    console.print(
        f"appended {count} events in {len(results)} write(s): seq {results[0].first_seq}"
        f"..{results[-1].last_seq}" + (f" ({replayed} replayed)" if replayed else "")
    )


@dead_app.command("list")
def dead_list(
    after_id: int = typer.Option(0, help="Cursor: list letters after this id."),
    limit: int = typer.Option(50, min=1, max=1000),
    as_json: bool = JsonOption,
) -> None:
    """List dead letters, oldest first."""
    with open_store() as store:
        letters = store.dead_letters.list(after_id=after_id, limit=limit)
    if as_json:
        print_json([letter.to_dict() for letter in letters])
        return
    table = id_table("id", "session", "key")
    table.add_column("error", max_width=60)
    table.add_column("when", no_wrap=True)
    for letter in letters:
        add_row(
            table,
            letter.id,
            letter.session_id,
            letter.idempotency_key,
            f"{letter.error_type}: {letter.error}"[:90],
            letter.created_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    print_table(table)


@dead_app.command("show")
def dead_show(letter_id: int, as_json: bool = JsonOption) -> None:
    """Show one dead letter with its original events."""
    with open_store() as store:
        letter = store.dead_letters.get(letter_id)
    if as_json:
        print_json(letter.to_dict(with_payload=True))
        return
    print_fields(letter.to_dict())
    console.print("[bold]events[/]:")
    console.print_json(letter.payload, ensure_ascii=True)  # a lone surrogate stays escaped


@dead_app.command("export")
def dead_export(
    out: Path = typer.Argument(..., help="The JSONL file to write (- for stdout)."),
    as_json: bool = JsonOption,
) -> None:
    """Write every dead letter, with its events (and raw body), as one JSON line each."""
    from rich.console import Console
    from rich.progress import Progress

    count = 0
    with ExitStack() as stack:
        stream = sys.stdout if str(out) == "-" else stack.enter_context(out.open("w"))
        store = stack.enter_context(open_store())
        progress = stack.enter_context(
            Progress(*Progress.get_default_columns(), console=Console(stderr=True))
        )
        bar = progress.add_task("exporting dead letters", total=None)
        for letter in store.dead_letters.iter_all():
            stream.write(json.dumps(letter.to_dict(with_payload=True), ensure_ascii=True) + "\n")
            count += 1
            progress.advance(bar)
    if as_json:
        print_json({"exported": count, "file": str(out)})
    elif str(out) != "-":
        console.print(f"exported {count} dead letter(s) to {out}")


@dead_app.command("replay")
def dead_replay(
    letter_id: int,
    fixed: Path | None = typer.Option(
        None, "--file", help="Replay these events instead (a JSON array or JSONL file)."
    ),
    expected_seq: int | None = typer.Option(
        None, "--expected-seq", min=0, help="Replay expecting this head instead of the letter's."
    ),
    no_expected_seq: bool = typer.Option(
        False, "--no-expected-seq", help="Replay without any expected head (append at the end)."
    ),
    key: str | None = typer.Option(
        None,
        "--key",
        help="Replay under this idempotency key instead of the letter's (for a write "
        "refused because its key had committed other content).",
    ),
    as_json: bool = JsonOption,
) -> None:
    """Append a dead letter under its original key (so it lands once), then remove it.

    A write rejected on a conflict can be replayed at another head (--expected-seq) or
    at whatever the head is now (--no-expected-seq); one whose key had committed other
    content (IdempotencyKeyReused), under a new key (--key).
    """
    from core.journal.dead_letters import KEEP, Keep

    if expected_seq is not None and no_expected_seq:
        raise typer.BadParameter(
            "give --expected-seq or --no-expected-seq, not both", param_hint="--no-expected-seq"
        )
    events = _load_fixed(fixed) if fixed else None
    override: int | Keep | None = KEEP
    if no_expected_seq:
        override = None
    elif expected_seq is not None:
        override = expected_seq
    with open_store() as store:
        letter = store.dead_letters.get(letter_id)
        result = store.dead_letters.replay(
            letter_id, store.append, events=events, expected_seq=override, idempotency_key=key
        )
    # the digest of what its producer sent, fixed or not: the answer to that producer
    _answer_producers(letter.session_id, key or letter.idempotency_key, result, letter.events)
    if as_json:
        print_json(result.to_dict())
    else:
        console.print(
            f"replayed dead letter {letter_id}: seq {result.first_seq}..{result.last_seq}"
        )


def _answer_producers(session_id: Any, key: Any, result: AppendResult, events: Any) -> None:
    """A producer looking up (session, key) learns that the write committed, no longer the
    rejection stored when it was dead-lettered; with the digest of what committed, so a
    producer of other content under the key is not taken for it. Best effort: the journal
    has the write."""
    if not isinstance(session_id, str) or not isinstance(key, str):
        return
    from tasks.app import get_app
    from tasks.outcomes import committed, digest_or_none, store_outcome

    try:
        # None for a letter no write could hold (replayed with --file)
        digest = digest_or_none(events)
        store_outcome(get_app(), session_id, key, committed(key, result, digest))
    except Exception as exc:  # the result backend away: only the lookup is stale
        err_console.print(plain(f"warning: could not record the outcome for producers: {exc}"))


def _load_fixed(path: Path) -> list[Any]:
    text = path.read_text()
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError:
        return [event for _, event in _read_jsonl(text.splitlines(), str(path))]
    return loaded if isinstance(loaded, list) else [loaded]


@dead_app.command("discard")
def dead_discard(
    letter_id: int,
    yes: bool = typer.Option(False, "--yes", help="Do not ask."),
    as_json: bool = JsonOption,
) -> None:
    """Delete a dead letter for good."""
    confirm(f"discard dead letter {letter_id}?", yes=yes)
    with open_store() as store:
        store.dead_letters.discard(letter_id)
    if as_json:
        print_json({"discarded": letter_id})
    else:
        console.print(f"discarded dead letter {letter_id}")
