"""What every command shares: app factory, consoles, settings, the store, output helpers.

Start-up matters (``sessionstore --help`` must beat ``celery --help``), so this module
imports only typer at module level: rich, pydantic and ``core.store`` load on first use.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from functools import cache
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from celery import Celery
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from core.settings import Settings
    from core.store import SessionStore


def new_app(help: str | None = None) -> typer.Typer:
    """A Typer app with the CLI's conventions. Plain (click) help text: it renders any
    text as written (no rich markup to break on ``[...]``) and loads no rich at start-up."""
    return typer.Typer(
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
        rich_markup_mode=None,
        help=help,
    )


# Off a terminal: lines as long as what they hold. Rich wraps at 80 columns there, which
# split ids and paths across lines for the script reading them.
UNWRAPPED_WIDTH = 100_000


@cache
def _console(stderr: bool) -> Console:
    console = new_console(stderr=stderr)
    if not console.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        console = new_console(stderr=stderr, width=UNWRAPPED_WIDTH, soft_wrap=True)
    return console


def new_console(**options: Any) -> Console:
    """A rich Console that leaves a closed pipe to ``tasks.cli.main`` (a silent exit 141):
    rich's own answer is exit 1."""
    return _console_class()(**options)


@cache
def _console_class() -> type[Console]:
    from rich.console import Console

    class PipedConsole(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    return PipedConsole


class _LazyConsole:
    """A rich Console built on first use (importing rich costs ~0.1 s)."""

    def __init__(self, stderr: bool) -> None:
        self._stderr = stderr

    def __getattr__(self, name: str) -> Any:
        return getattr(_console(self._stderr), name)

    # Special methods bypass __getattr__: rich's Progress and Live use the console in a
    # ``with`` block.
    def __enter__(self) -> Any:
        return _console(self._stderr).__enter__()

    def __exit__(self, *exc: Any) -> None:
        _console(self._stderr).__exit__(*exc)


if TYPE_CHECKING:
    console: Console
    err_console: Console
else:
    console = _LazyConsole(False)
    err_console = _LazyConsole(True)

JsonOption = typer.Option(False, "--json", help="Machine-readable JSON output.")

# The largest seq or position the journal holds (BIGINT): the bound of options taking one.
INT64_MAX = 2**63 - 1
# A tenant id's length, as the journal checks it (``create_session``, ``move``).
MAX_TENANT_LENGTH = 128


def check_tenant(value: str | None) -> str | None:
    """A ``--tenant`` value: 1..128 characters, a usage error (exit 2) naming the option
    otherwise, as the options' other bounds are (an empty one was exit 3, "invalid event")."""
    if value is not None and not 0 < len(value) <= MAX_TENANT_LENGTH:
        raise typer.BadParameter(f"a tenant is 1..{MAX_TENANT_LENGTH} characters, not {len(value)}")
    return value


def metrics_port_option(what: str) -> Any:
    """``--metrics-port``: a worker's and a watcher's Prometheus endpoint."""
    return typer.Option(None, "--metrics-port", min=1, max=65535, help=what)


MetricsAddrOption = typer.Option("127.0.0.1", "--metrics-addr", help="Address to bind.")

TenantOption = typer.Option(
    None,
    "--tenant",
    callback=check_tenant,
    help="The session's tenant: required where its external id names sessions of several.",
)


def confirm(question: str, *, yes: bool) -> None:
    """Go on if ``yes`` (``--yes``) or the answer is yes (from a terminal, or piped: ``yes
    |``); the question on stderr (stdout holds ``--json``'s document). No answer at all
    (stdin closed: a script's run) is a usage error saying to pass ``--yes``, where the
    prompt went to stdout and the run ended in "Aborted!"."""
    if yes:
        return
    # not click's confirm: its input() writes a space to stdout even with err=True
    sys.stderr.write(f"{question} [y/N]: ")
    sys.stderr.flush()
    stdin = sys.stdin  # None when descriptor 0 is closed (``<&-``)
    line = stdin.readline() if stdin is not None else ""
    if not line and (stdin is None or not stdin.isatty()):
        sys.stderr.write("\n")
        raise typer.BadParameter(
            f"{question} No answer on stdin (not a terminal): pass --yes", param_hint="--yes"
        )
    if line.strip().lower() not in ("y", "yes"):
        raise typer.Abort()


def load_settings() -> Settings:
    """``Settings()`` from the environment; a bad value is a one-line BadConfig."""
    import pydantic

    from core.errors import BadConfig
    from core.settings import Settings, warn_unknown_variables

    warn_unknown_variables()
    try:
        return Settings()
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "settings"
        raise BadConfig(f"bad setting {where}: {first.get('msg')}") from None


@contextmanager
def open_store(*, create: bool = False) -> Iterator[SessionStore]:
    """The store of the configured database. Read-only commands pass ``create=False`` (the
    default): a missing embedded database is then an error naming its path, never a new
    empty file. The embedded schema is created or upgraded on open (``core``)."""
    from core.store import SessionStore

    with SessionStore.from_settings(load_settings(), create=create) as store:
        yield store


def print_json(value: Any) -> None:
    """``value`` as indented JSON, exactly (``_exact_json``)."""
    typer.echo(_exact_json(value, indent=True))


def print_json_line(value: Any) -> None:
    """``value`` as one line of JSON (JSON Lines: a stream of results, one per line), exactly
    as ``print_json`` writes it, and flushed: a reader of the pipe sees each line at once."""
    typer.echo(_exact_json(value, indent=False))
    sys.stdout.flush()


def _exact_json(value: Any, *, indent: bool) -> str:
    """JSON text of ``value``, exactly (DESIGN invariant 11): key order, ``-0.0`` and
    integers of any size. orjson writes all but integers beyond 64 bits, which it refuses;
    the standard library writes those (as ``core.exact_json`` does for the journal)."""
    import orjson

    try:
        return orjson.dumps(
            value, default=str, option=orjson.OPT_INDENT_2 if indent else 0
        ).decode()
    except orjson.JSONEncodeError:
        import json

        text = json.dumps(
            value,
            default=_json_default,
            ensure_ascii=False,
            **({"indent": 2} if indent else {"separators": (",", ":")}),
        )
        # orjson refuses lone surrogates too (a file name that is not UTF-8, as os.fsdecode
        # reads it): each is written as its JSON escape, so the output stays UTF-8 and
        # json.loads gives the name back (os.fsencode then its bytes).
        from core.exact_json import escape_lone_surrogates

        return escape_lone_surrogates(text)


def _json_default(value: Any) -> Any:
    """What orjson writes for the non-JSON values records hold (datetimes as ISO 8601)."""
    from datetime import date, time

    return value.isoformat() if isinstance(value, date | time) else str(value)


# What a terminal acts on rather than shows: C0 (a newline and a tab too: a stored value
# never starts a line of its own, which could pass for another field or event) and C1
# controls; the line and paragraph separators; bidirectional overrides, embeddings and
# isolates (U+202E turns "/w\u202egnp.exe" into "/wexe.png"); invisible marks (the zero-width
# space, word joiner, BOM). The joiners U+200C/U+200D stay: scripts and emoji need them.
_CONTROL = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u180e\u200b\u200e\u200f\u2028-\u202e\u2060\u2066-\u2069\ufeff"
    "\ud800-\udfff]"  # and lone surrogates: a file name's byte that is not UTF-8 (path_text)
)


def plain(value: object) -> Text:
    """A stored value as literal rich text on one line: ``[/x]`` is not markup, and a
    control character (``_CONTROL``) shows as its escape (``\\x1b``, ``\\u202e``) instead
    of reaching the terminal. Every value from stored data goes through here before a table
    or the console prints it."""
    from rich.text import Text

    return Text(literal("" if value is None else str(value)))


def literal(text: str) -> str:
    """``text`` with each control character (``_CONTROL``) and lone surrogate as its escape:
    for a line printed without rich (``plain`` is this as rich text)."""
    return _CONTROL.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    from core.fsio import path_text

    code = ord(match[0])
    if 0xD800 <= code <= 0xDFFF:
        return path_text(match[0])  # a file name's byte that is not UTF-8 as \xff
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def add_row(table: Table, *values: object) -> None:
    """A row of literal cells (``plain``)."""
    table.add_row(*(plain(value) for value in values))


def print_fields(fields: Mapping[str, object] | Iterable[tuple[str, object]]) -> None:
    """``key: value`` lines, keys in bold, values literal (``plain``)."""
    from rich.text import Text

    items = fields.items() if isinstance(fields, Mapping) else fields
    for key, value in items:
        console.print(Text.assemble((key, "bold"), ": ", plain(value)), highlight=False)


def new_table(*headers: str, **options: Any) -> Table:
    """A rich Table (rich is imported on first use, not at start-up)."""
    from rich.table import Table

    return Table(*headers, **options)


def id_table(*ids: str, **options: Any) -> Table:
    """A table whose first columns are ids: shown whole, never cut or wrapped (an operator
    copies them into commands). Print it with ``print_table``."""
    table = new_table(**options)
    for name in ids:
        table.add_column(name, no_wrap=True, overflow="fold")
    return table


def print_table(table: Table) -> None:
    """Print ``table`` on a console widened to the table's minimum width, so that no-wrap id
    columns are never truncated on a narrow terminal (COLUMNS=80); off a terminal the
    console is wide enough for the table's every cell on one line (``UNWRAPPED_WIDTH``)."""
    from rich.measure import Measurement

    wide = new_console(width=10_000)
    needed = Measurement.get(wide, wide.options, table).minimum
    if needed <= console.width:
        console.print(table)
    else:
        new_console(width=needed).print(table)


def queue_app(stack: ExitStack) -> Celery:
    """The Celery app a command enqueues through. With the embedded broker nothing else
    consumes its queue, so a worker runs in this process until ``stack`` closes (as
    ``append --enqueue`` and ``export --via-queue`` need; with Redis, the workers do). With
    a broker that is unreachable, the first retry of a publish says so (it was silent for as
    long as the retries last, two minutes by default)."""
    from tasks.app import get_app, settings_of
    from tasks.embedded import embedded_worker

    celery_app = get_app()
    settings = settings_of(celery_app)
    if settings.is_embedded_broker:  # this command's own: no mailbox left behind
        stack.enter_context(embedded_worker(celery_app, remote_control=False))
        return celery_app
    told: list[bool] = []

    def say_once(exc: BaseException, interval: float) -> None:  # kombu's errback, per retry
        if not told:
            told.append(True)
            err_console.print(
                plain(
                    f"the broker is unreachable ({exc}); retrying for up to "
                    f"{settings.publish_retry_seconds:g} s (SESSIONSTORE_PUBLISH_RETRY_SECONDS)"
                ),
                soft_wrap=True,
            )

    policy = dict(celery_app.conf.task_publish_retry_policy or {})
    celery_app.conf.task_publish_retry_policy = {**policy, "errback": say_once}
    return celery_app
