"""``sessionstore append`` and ``sessionstore dead-letters``."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import typer

from core.errors import InvalidEvent
from tasks.cli.common import (
    INT64_MAX,
    JsonOption,
    TenantOption,
    add_row,
    confirm,
    console,
    err_console,
    id_table,
    load_settings,
    new_app,
    open_store,
    plain,
    print_fields,
    print_json,
    print_table,
    queue_app,
)

if TYPE_CHECKING:
    from core.journal.validation import CheckedEvents
    from core.records import AppendResult
    from core.settings import Settings

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


def _decoded(lines: Iterable[bytes], source: str) -> Iterator[str]:
    """Each line as UTF-8, strictly, whatever the locale: a byte that is not UTF-8 names
    its line (the codec's error named a position in a read buffer, and no file)."""
    for number, raw in enumerate(lines, start=1):
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidEvent(
                "",
                f"{source} line {number}: not UTF-8 (byte 0x{raw[exc.start]:02x} at byte "
                f"{exc.start + 1} of the line)",
            ) from None


def _read_input(stream: Iterable[bytes], source: str) -> tuple[list[int], list[Any]]:
    """The whole input parsed, before anything of it is written: (the input line of each
    event, the events). Only the events are kept, not the text."""
    lines: list[int] = []
    events: list[Any] = []
    for number, event in _read_jsonl(_decoded(stream, source), source):
        lines.append(number)
        events.append(event)
    return lines, events


def _on_line(exc: InvalidEvent, lines: list[int], first: int, source: str) -> InvalidEvent:
    """``exc`` about event ``first + exc.index`` of the input, naming that event's line."""
    if exc.index is None or not 0 <= first + exc.index < len(lines):
        return exc
    return InvalidEvent(exc.field, f"{source} line {lines[first + exc.index]}: {exc.reason}")


# Batch N is written under KEY:N: the journal's key limit (MAX_KEY_LENGTH, 200) less room
# for ":" and up to 9 digits. A literal: the validation module is not imported for --help.
MAX_APPEND_KEY_LENGTH = 190


def _opened(source: str) -> IO[bytes]:
    """The events file to append, open; one it cannot open is ``UnreadableFile`` naming it
    (exit 3, "cannot read x.jsonl: No such file or directory"), not a bare errno."""
    from core.errors import UnreadableFile

    try:
        return Path(source).open("rb")
    except OSError as exc:
        raise UnreadableFile(source, exc.strerror or str(exc)) from None


def _check_key(key: str | None) -> None:
    if key is None:
        return
    if not key:  # it turned idempotency off without a word
        raise typer.BadParameter("must not be empty", param_hint="--key")
    if len(key) > MAX_APPEND_KEY_LENGTH:
        raise typer.BadParameter(
            f"at most {MAX_APPEND_KEY_LENGTH} characters (batch N is written under KEY:N), "
            f"not {len(key)}",
            param_hint="--key",
        )
    from core.journal.validation import MAX_KEY_LENGTH, check_id

    try:
        check_id(f"{key}:0", "idempotency_key", MAX_KEY_LENGTH)
    except InvalidEvent as exc:
        raise typer.BadParameter(exc.reason, param_hint="--key") from None


@cli.command("append")
def append(
    session_id: str = typer.Argument(..., help="The session to append to."),
    source: str = typer.Argument("-", help="A JSONL file of events (UTF-8), or - for stdin."),
    enqueue: bool = typer.Option(False, "--enqueue", help="Go through the queue (a worker)."),
    key: str | None = typer.Option(
        None,
        help=f"Idempotency key of 1..{MAX_APPEND_KEY_LENGTH} characters: batch N is written "
        "under KEY:N, so the same command run again writes only what had not committed.",
    ),
    expected_seq: int | None = typer.Option(
        None, min=0, max=INT64_MAX, help="Fail unless the head is this seq."
    ),
    batch_size: int = typer.Option(
        100, min=1, help="Events per write, at most SESSIONSTORE_MAX_BATCH_EVENTS (1000)."
    ),
    tenant: str | None = TenantOption,
    as_json: bool = JsonOption,
) -> None:
    """Append events from a JSONL file or stdin, one write per batch.

    The whole input is read and checked first: a line that is not UTF-8 or not JSON, or
    an event the journal would refuse, is named and nothing is written. A write that fails
    after others committed reports which did (on stdout too with --json).
    """
    _check_key(key)
    max_batch = load_settings().max_batch_events
    if batch_size > max_batch:
        raise typer.BadParameter(
            f"at most {max_batch} (SESSIONSTORE_MAX_BATCH_EVENTS), not {batch_size}",
            param_hint="--batch-size",
        )
    name = "stdin" if source == "-" else source
    with ExitStack() as stack:
        stream = sys.stdin.buffer if source == "-" else stack.enter_context(_opened(source))
        # an existing database only: a mistyped data dir is no new empty journal
        store = stack.enter_context(open_store())
        # before anything is read or sent: an unknown session is not found here (exit 4), as
        # on the direct path, not a dead letter the queue makes of every batch
        session_id = store.resolve_session(session_id, tenant_id=tenant).id
        lines, events = _read_input(stream, name)
        batches = range(0, len(events), batch_size)
        if enqueue:
            _check_queued(store.settings, session_id, events, batches, batch_size, lines, name)
            writer = _queue_writer(stack)
            payload: Sequence[Any] | CheckedEvents = events
        else:
            from core.journal.validation import checked

            writer = store.append
            try:
                payload = checked(events, max_depth=store.settings.max_event_depth)
            except InvalidEvent as exc:
                raise _on_line(exc, lines, 0, name) from None
        writes = ((first, payload[first : first + batch_size]) for first in batches)
        results = _write(writer, session_id, writes, expected_seq, key, lines, name, as_json)
    _report(results, as_json)


def _check_queued(
    settings: Settings,
    session_id: str,
    events: list[Any],
    batches: range,
    size: int,
    lines: list[int],
    source: str,
) -> None:
    """Every batch checked as the producer and the worker check it, before any is sent."""
    from tasks.producer import validate_write

    for first in batches:
        try:
            validate_write(settings, session_id, events[first : first + size], None, None)
        except InvalidEvent as exc:
            raise _on_line(exc, lines, first, source) from None


def _write(
    writer: Callable[..., AppendResult],
    session_id: str,
    writes: Iterable[tuple[int, Sequence[Any] | CheckedEvents]],
    expected_seq: int | None,
    key: str | None,
    lines: list[int],
    source: str,
    as_json: bool,
) -> list[AppendResult]:
    results: list[AppendResult] = []
    expected = expected_seq
    try:
        for n, (first, events) in enumerate(writes):
            try:
                result = writer(
                    session_id,
                    events,
                    expected_seq=expected,
                    idempotency_key=None if key is None else f"{key}:{n}",
                )
            except InvalidEvent as exc:
                raise _on_line(exc, lines, first, source) from None
            results.append(result)
            expected = result.last_seq if expected is not None else None
    except BaseException:  # Ctrl-C too: what committed stays, and the user must know it
        if results:
            _report_partial(results, lines, key, as_json)
        raise
    return results


def _report_partial(
    results: list[AppendResult], lines: list[int], key: str | None, as_json: bool
) -> None:
    """Which writes committed before a failure, and where the rest of the input starts."""
    count = sum(r.last_seq - r.first_seq + 1 for r in results)
    resume = lines[count] if count < len(lines) else None
    if as_json:
        print_json(
            {
                "complete": False,
                "committed": [r.to_dict() for r in results],
                "resume_from_line": resume,
            }
        )
    again = (
        "running the same command again (same --key) writes only the rest"
        if key is not None
        else f"the rest starts at input line {resume}"
    )
    err_console.print(
        plain(
            f"committed {count} events in {len(results)} write(s) before the failure: seq "
            f"{results[0].first_seq}..{results[-1].last_seq}, input lines {lines[0]}.."
            f"{lines[count - 1]}; {again}"
        ),
        soft_wrap=True,
    )


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
    after_id: int = typer.Option(
        0, min=0, max=INT64_MAX, help="Cursor: list letters after this id."
    ),
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


# a letter's id (a BIGINT): out of range is a usage error, as a seq or position is
LetterIdArgument = typer.Argument(..., min=0, max=INT64_MAX, help="The dead letter's id.")


@dead_app.command("show")
def dead_show(letter_id: int = LetterIdArgument, as_json: bool = JsonOption) -> None:
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
    """Write every dead letter, with its events (and raw body), as one JSON line each.

    To stdout (-), the lines are all stdout holds: the count goes to stderr, or nowhere
    with --json."""
    from rich.progress import Progress

    from core.fsio import published_text

    to_stdout = str(out) == "-"
    count = 0
    with ExitStack() as stack:
        # a file is published whole (a name of its own, renamed over ``out``): a failure
        # part way leaves what was there, never a half-written export under its name
        stream = sys.stdout if to_stdout else stack.enter_context(published_text(out))
        store = stack.enter_context(open_store())
        # a bar only for a person watching: not in a log, nor with --json (a program reads)
        progress = stack.enter_context(
            Progress(
                *Progress.get_default_columns(),
                console=err_console,
                transient=True,
                disable=as_json or not err_console.is_terminal,
            )
        )
        bar = progress.add_task("exporting dead letters", total=None)
        for letter in store.dead_letters.iter_all():
            stream.write(json.dumps(letter.to_dict(with_payload=True), ensure_ascii=True) + "\n")
            count += 1
            progress.advance(bar)
    if to_stdout:
        if not as_json:
            err_console.print(f"exported {count} dead letter(s)")
    elif as_json:
        print_json({"exported": count, "file": str(out)})
    else:
        console.print(plain(f"exported {count} dead letter(s) to {out}"))


@dead_app.command("replay")
def dead_replay(
    letter_id: int = LetterIdArgument,
    fixed: Path | None = typer.Option(
        None, "--file", help="Replay these events instead (a JSON array or JSONL file)."
    ),
    expected_seq: int | None = typer.Option(
        None,
        "--expected-seq",
        min=0,
        max=INT64_MAX,
        help="Replay expecting this head instead of the letter's.",
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
    letter_id: int = LetterIdArgument,
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
