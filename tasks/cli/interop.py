"""``sessionstore import`` / ``export`` / ``sessions create``: agent session files in and out.

Heavy imports stay inside the commands (the CLI starts lazily)."""

from __future__ import annotations

import logging
import os
import stat
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated

import typer

from tasks.cli.common import (
    INT64_MAX,
    JsonOption,
    MetricsAddrOption,
    check_tenant,
    console,
    err_console,
    load_settings,
    metrics_port_option,
    new_app,
    open_store,
    plain,
    print_json,
    print_json_line,
    queue_app,
)

cli = new_app()
log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from core.errors import SessionFileNotStarted, UnlistableDirectory
    from core.interop.importer import ImportResult
    from core.store import SessionStore

DEFAULT_TENANT = "default"


def _result_dict(result: ImportResult) -> dict[str, object]:
    found: dict[str, object] = {
        "path": result.path,
        "session_id": result.session_id,
        "external_id": result.external_id,
        "appended": result.appended,
        "skipped": result.skipped,
        "status": result.status,
    }
    if result.missing_blobs:  # oh-my-pi refs the session holds without bytes (kept as refs)
        found["missing_blobs"] = result.missing_blobs
    if result.found_late_blobs:  # of those, found now: a fresh import would store them
        found["found_late_blobs"] = result.found_late_blobs
    if result.invalid_utf8_lines:  # read with U+FFFD for the bad bytes, as pi reads them
        found["invalid_utf8_lines"] = result.invalid_utf8_lines
    if result.ignored_lines:  # lines holding no entry: not imported
        found["ignored_lines"] = [
            {"line": skipped.line, "reason": skipped.reason} for skipped in result.ignored_lines
        ]
    if result.incomplete_tail:  # a last line not imported yet: it waits for the next pass
        found["incomplete_tail"] = True
    if result.taken_up:  # appended by a concurrent (or interrupted) import of the file
        found["taken_up"] = result.taken_up
    return found


def _error_dict(path: Path, exc: Exception) -> dict[str, object]:
    from core.errors import ImportConflict, ImportInterrupted

    found: dict[str, object] = {
        "path": str(path),
        "session_id": None,
        "external_id": None,
        "appended": 0,
        "skipped": 0,
        "status": "error",
        "error": _message(path, exc),
    }
    if isinstance(exc, ImportConflict):  # nothing written: the session that holds the file
        found.update(session_id=exc.session_id, external_id=exc.external_id)
    if isinstance(exc, ImportInterrupted):  # it had written: what, and where
        found.update(
            session_id=exc.session_id,
            external_id=exc.external_id,
            appended=exc.appended,
            skipped=exc.skipped,
        )
    return found


@cli.command("import")
def import_files(
    paths: Annotated[
        list[str] | None,
        typer.Argument(
            help="Session files, directories (recursive) or globs [default: ~/.pi/agent/sessions]."
        ),
    ] = None,
    tenant: str = typer.Option(
        DEFAULT_TENANT, callback=check_tenant, help="Tenant of the imported sessions."
    ),
    format: str = typer.Option("auto", "--format", help="auto | pi | omp | claude-code."),
    blobs_dir: Path | None = typer.Option(
        None,
        "--blobs-dir",
        help="oh-my-pi's blob directory [default: <agent dir>/blobs next to the sessions, "
        "else blobs/ beside the file (as export --format omp writes it), else "
        "~/.omp/agent/blobs].",
    ),
    watch: Path | None = typer.Option(
        None, "--watch", help="Then follow this directory: new files and appended lines."
    ),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="JSON Lines: one object per file imported (and per pass with --watch), "
        "a failed file's error object too.",
    ),
    metrics_port: int | None = metrics_port_option(
        "With --watch: serve Prometheus /metrics (import throughput) on this port."
    ),
    metrics_addr: str = MetricsAddrOption,
) -> None:
    """Import agent session files; again appends only what is new (idempotent).

    A file that fails is reported and the next one imported; the exit code is the highest
    of the failed files' (README: Exit codes). A failure no other file can get past (a bad
    setting, the database or a store unavailable) ends the run there, with its code."""
    from core.errors import SessionFileNotStarted, UnreadableFile
    from core.interop.importer import converters
    from core.interop.watch import DEFAULT_SESSIONS_DIR, check_followable, session_files

    if metrics_port is not None:
        # Imports run in this process, not in a worker: the import panels of the dashboard
        # read a watcher's own /metrics (a one-shot import ends before any scrape).
        if watch is None:
            raise typer.BadParameter(
                "serves metrics while --watch follows", param_hint="--metrics-port"
            )
        from tasks.metrics import serve_process_metrics

        name = f"import-{os.getpid()}"
        serve_process_metrics(load_settings(), metrics_port, metrics_addr, name=name)
    known = sorted(converters())
    if format != "auto" and format not in known:  # before any file: it fails every one
        raise typer.BadParameter(
            f"unknown format {format!r} (known: auto, {', '.join(known)})", param_hint="--format"
        )
    if watch is not None:
        try:  # before any file, and before a journal is made for a run that cannot follow
            check_followable(watch)
        except UnreadableFile as exc:
            if as_json:  # its object, then the one line of every failure
                print_json_line(_error_dict(watch, exc))
            raise

    # the default directory may not exist (nothing to import); a path named must
    default = (
        [] if watch or not DEFAULT_SESSIONS_DIR.expanduser().is_dir() else [DEFAULT_SESSIONS_DIR]
    )
    files, unlisted = session_files(paths or default)
    if watch is not None:  # what the follow lists is its own: imported, said, counted once
        files, unlisted = _not_followed(files, unlisted, watch)
    if not files and not unlisted and watch is None:
        shown = " ".join(paths) if paths else str(DEFAULT_SESSIONS_DIR)
        err_console.print(plain(f"no session files (*.jsonl) in {shown}"))
    # each failed path's error: the run's exit code is the highest of theirs
    failed: dict[Path, Exception] = {}

    def fail(path: Path, exc: Exception) -> None:
        _failed(path, exc, as_json)
        failed[path] = exc

    for error in unlisted:  # reported as a file that cannot be read is, before the files
        fail(Path(error.path), error)
    with ExitStack() as stack:
        # The journal is created for a file there is to import, not for a path that names
        # none (a mistyped data dir then held an empty journal).
        opened: list[SessionStore] = []

        def store() -> SessionStore:
            if not opened:
                opened.append(stack.enter_context(open_store(create=True)))
            return opened[0]

        with _progress(len(files), sum(_size(f) for f in files), quiet=as_json) as advance:
            for path in files:
                try:
                    _check_readable(path)
                except UnreadableFile as exc:
                    fail(path, exc)
                    advance(_size(path))
                    continue
                journal = store()  # outside the file's try: no database fails the command
                try:
                    result = journal.import_session(
                        path,
                        tenant_id=tenant,
                        format=format,
                        blobs_dir=blobs_dir,
                        # a new file written to a moment ago whose lines give no header yet
                        # (Claude Code's first lines): its next import makes the session
                        wait_for_header=_written_lately(path),
                    )
                except SessionFileNotStarted as exc:  # nothing to import yet, nothing wrong
                    _report_not_started(exc, as_json)
                except Exception as exc:
                    if watch is None and _stops_the_run(exc):
                        if as_json:  # the file's object, then the one line of every failure
                            print_json_line(_error_dict(path, exc))
                        raise
                    fail(path, exc)
                else:
                    _report(result, as_json)
                advance(_size(path))
        exit_code = max((_code(exc) for exc in failed.values()), default=0)
        if watch is not None:
            exit_code = max(exit_code, _follow(store(), watch, tenant, format, as_json))
    if exit_code:
        raise typer.Exit(exit_code)


def _stops_the_run(exc: Exception) -> bool:
    """A failure every other file would meet: the setting, the database or a store, not
    this file or its session (a move of it pending fails it alone)."""
    from core.errors import ImportInterrupted, SessionMoving
    from tasks.cli.failures import ENVIRONMENT, classify

    cause = exc.cause if isinstance(exc, ImportInterrupted) else exc
    classified = classify(cause)
    return (
        not isinstance(cause, SessionMoving)
        and classified is not None
        and classified[0] in ENVIRONMENT
    )


def _check_readable(path: Path) -> None:
    """``UnreadableFile`` for a path that is no readable regular file, before any journal
    is opened (the import's own check says why; a file readable after all is imported)."""
    try:
        readable = stat.S_ISREG(os.stat(path).st_mode) and os.access(path, os.R_OK)
    except OSError:
        readable = False
    if not readable:
        from core.interop.importer import read_file

        read_file(path)


def _written_lately(path: Path) -> bool:
    from core.interop.importer import written_lately

    try:
        return written_lately(path.stat().st_mtime_ns)
    except OSError:
        return False


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _report(result: ImportResult, as_json: bool) -> None:
    if as_json:
        print_json_line(_result_dict(result))
        return
    tail = " (a half-written last line waits)" if result.incomplete_tail else ""
    if result.missing_blobs:
        tail += f"; {len(result.missing_blobs)} blob(s) missing, refs kept"
    if result.found_late_blobs:
        tail += (
            f" ({len(result.found_late_blobs)} found now, after the entries were imported "
            "without them: delete the session and import again to store them)"
        )
    if result.invalid_utf8_lines:
        tail += f"; {result.invalid_utf8_lines} line(s) of invalid UTF-8 read with U+FFFD"
    if result.ignored_lines:
        shown = ", ".join(f"{s.line} ({s.reason})" for s in result.ignored_lines[:10])
        more = ", …" if len(result.ignored_lines) > 10 else ""
        tail += (
            f"; {len(result.ignored_lines)} line(s) holding no entry not imported: {shown}{more}"
        )
    if result.taken_up:
        tail += f"; {result.taken_up} appended by another import of the file"
    console.print(
        plain(
            f"{result.status}: {result.path} -> {result.session_id} "
            f"({result.external_id}): {result.appended} appended, {result.skipped} skipped{tail}"
        ),
        highlight=False,
    )


def _report_not_started(exc: SessionFileNotStarted, as_json: bool) -> None:
    """A file with no line yet (an agent has just opened it): said as a skip, not failed."""
    status = "empty" if exc.empty else "unfinished"  # or its header's lines still to come
    if as_json:
        print_json_line(
            {
                "path": exc.field,
                "session_id": None,
                "external_id": None,
                "appended": 0,
                "skipped": 0,
                "status": status,
                "reason": exc.reason,
            }
        )
        return
    console.print(
        plain(f"{status}: {exc.field}: {exc.reason}, nothing imported"),
        highlight=False,
        soft_wrap=True,
    )


def _message(path: Path, exc: Exception) -> str:
    """A typed error's message as the CLI gives it (``classify``: it names the file);
    anything else is a defect, named by its type and the file it failed on."""
    classified = _classified(exc)
    if classified is not None:
        return classified[1]
    return f"importing {path} failed: {type(exc).__name__}: {exc}"


def _classified(exc: Exception) -> tuple[int, str] | None:
    """``classify`` for a typed error; None for anything else, a defect of the import."""
    from core.errors import SessionStoreError
    from tasks.cli.failures import classify

    return classify(exc) if isinstance(exc, SessionStoreError) else None


def _failed(path: Path, exc: Exception, as_json: bool) -> None:
    """Report a file's failure (a defect's traceback logged): the run goes on with the next
    file, and its exit code is ``_code``'s of the failures."""
    if _classified(exc) is None:
        log.exception("importing a file failed", extra={"path": str(path)})
    _report_error(path, exc, as_json)


def _code(exc: Exception) -> int:
    """A file's failure as an exit code: ``classify``'s, 1 for a defect."""
    from tasks.cli.failures import ExitCode

    classified = _classified(exc)
    return int(classified[0]) if classified else int(ExitCode.FAILED)


def _report_error(path: Path, exc: Exception, as_json: bool) -> None:
    if as_json:
        print_json_line(_error_dict(path, exc))
    else:
        message = _message(path, exc)
        err_console.print(plain(f"error: {message}"), highlight=False, soft_wrap=True)


def _not_followed(
    files: list[Path], unlisted: list[UnlistableDirectory], directory: Path
) -> tuple[list[Path], list[UnlistableDirectory]]:
    """The files and unlisted directories named that a follow of ``directory`` does not
    list (by identity: a path through a link to a file it lists is that file). Those it
    lists are its own: its first scan imports them (a new Claude Code file waiting for its
    header line as any other), and it says a failure once and counts it while it lasts."""
    from core.interop.watch import session_files, would_follow

    def identity(path: Path | str) -> tuple[int, int] | None:
        try:
            found = os.stat(path)
        except OSError:
            return None
        return found.st_dev, found.st_ino

    followed = session_files([directory])
    own = {identity(p) for p in followed.files} | {identity(e.path) for e in followed.unlisted}
    own.discard(None)

    def its_own(path: Path | str) -> bool:
        found = identity(path)
        # one not there yet: the follow's if it would import it once it is
        return found in own if found is not None else would_follow(directory, Path(path))

    return (
        [p for p in files if not its_own(p)],
        [e for e in unlisted if not its_own(e.path)],
    )


def _follow(
    store: object,
    directory: Path,
    tenant: str,
    format: str,
    as_json: bool,
) -> int:
    """Follow ``directory`` until Ctrl-C; then the highest exit code of the files whose
    last import failed (a file imported since, or gone, no longer counts), 0 if none."""
    from core.interop.watch import Follower
    from core.store import SessionStore

    assert isinstance(store, SessionStore)
    err_console.print(plain(f"following {directory} (Ctrl-C to stop)"))
    follower = Follower(
        store,
        directory,
        tenant_id=tenant,
        format=format,
        on_result=lambda r: _report(r, as_json),
        on_error=lambda p, e: _report_error(p, e, as_json),
    )
    try:
        follower.run()
    except KeyboardInterrupt:  # how a follow ends: with the code of the files still failed
        return max((_code(exc) for exc in follower.failing.values()), default=0)
    return 0  # unreachable: a follow without a stop event runs until it is interrupted


class _progress:
    """A rich bar over files and bytes on stderr; nothing with --json or off a terminal."""

    def __init__(self, files: int, total_bytes: int, *, quiet: bool) -> None:
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

        self.progress = Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TextColumn("{task.fields[files]}"),
            console=err_console,
            disable=quiet or not err_console.is_terminal,
            transient=True,
        )
        self.files = files
        self.task = self.progress.add_task("importing", total=total_bytes, files=f"0/{files} files")
        self.done = 0

    def __enter__(self) -> Callable[[int], None]:
        self.progress.__enter__()
        return self.advance

    def advance(self, size: int) -> None:
        self.done += 1
        self.progress.update(self.task, advance=size, files=f"{self.done}/{self.files} files")

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(None, None, None)


@cli.command("export")
def export(
    session: str = typer.Argument(help="Session id, or its external id (the agent's own)."),
    output: Path | None = typer.Option(
        None,
        "-o",
        "--output",
        help="File, - for stdout [default: stdout]; omp: a directory [default: .] (with "
        "--via-queue: a file).",
    ),
    format: str = typer.Option(
        "pi",
        "--format",
        help="pi (a version-3 pi session file) | omp (oh-my-pi's layout) | events (the "
        "journal's events as JSONL; with --via-queue).",
    ),
    blobs_dir: Path | None = typer.Option(
        None,
        "--blobs-dir",
        help="omp: where the blobs go [default: <agent dir>/blobs when the output is "
        "<agent dir>/sessions/<project>, else <output>/blobs].",
    ),
    at_seq: int | None = typer.Option(
        None,
        "--at-seq",
        min=0,
        max=INT64_MAX,
        help="Only events up to this seq (0: the header alone).",
    ),
    tenant: str | None = typer.Option(
        None, callback=check_tenant, help="Fail unless the session is this tenant's."
    ),
    via_queue: bool = typer.Option(
        False, "--via-queue", help="Have a worker build it (sessionstore.rehydrate) and wait."
    ),
    timeout: float | None = typer.Option(
        None,
        "--timeout",
        min=0.1,
        help="With --via-queue: fail (exit 1) when the worker's result takes longer than "
        "this many seconds [default: twice SESSIONSTORE_REHYDRATE_STALL_SECONDS].",
    ),
    as_json: bool = JsonOption,
) -> None:
    """Write a session as a pi session file (header, then every entry as it was), or as
    oh-my-pi's layout (the file, its artifacts directory, its blobs). ``--via-queue``: a
    worker builds it (pi, or the journal's ``events`` as JSONL) and this waits for it."""
    known = ("pi", "omp", "events") if via_queue else ("pi", "omp")
    if format not in known:
        also = "; events with --via-queue" if format == "events" else ""
        raise typer.BadParameter(
            f"unknown export format {format!r} (known: {', '.join(known)}{also})",
            param_hint="--format",
        )
    if output == Path("-"):  # stdout, as dead-letters export's "-" (it was a file named -)
        if format == "omp" and not via_queue:
            raise typer.BadParameter("omp writes a directory, not stdout", param_hint="--output")
        output = None
    if via_queue:
        _export_via_queue(session, output, format, at_seq, tenant, as_json, timeout)
        return
    if format == "omp":
        _export_omp(session, output or Path("."), blobs_dir, at_seq, tenant, as_json)
        return
    from core.errors import ExportIncomplete
    from core.fsio import published_text

    incomplete: ExportIncomplete | None = None
    with open_store() as store:
        if output is None:
            store.export_session(session, sys.stdout, at_seq=at_seq, tenant_id=tenant)
            return
        if output.is_dir():
            raise typer.BadParameter(f"{output} is a directory", param_hint="--output")
        with published_text(output) as out:  # never a half-written export under the final name
            try:
                lines = store.export_session(session, out, at_seq=at_seq, tenant_id=tenant)
            except ExportIncomplete as exc:  # written whole: kept, and reported below
                incomplete, lines = exc, exc.result
    if as_json:
        print_json(
            {"path": str(output), "lines": lines, "session": session}
            | ({"missing_blobs": incomplete.hashes} if incomplete else {})
        )
    else:
        err_console.print(plain(f"wrote {lines} lines to {output}"))
    if incomplete is not None:
        raise incomplete  # exit 1: the file holds refs where values should be


def _export_via_queue(
    session: str,
    output: Path | None,
    fmt: str,
    at_seq: int | None,
    tenant: str | None,
    as_json: bool,
    timeout: float | None,
) -> None:
    """Ask the workers for the export, show their progress, then write what they built;
    ``NotFinishedInTime`` past ``timeout`` (a build hung on a stalled read is taken over
    after SESSIONSTORE_REHYDRATE_STALL_SECONDS without progress, so the default waits
    twice that)."""
    import time

    if output is not None and output.is_dir():  # before any work: a worker builds one file
        raise typer.BadParameter(
            f"{output} is a directory: with --via-queue the export is one file (omp's too: "
            "its images as refs into this store)",
            param_hint="--output",
        )

    from rich.progress import Progress

    from core.errors import NotFinishedInTime
    from tasks import enqueue_rehydrate

    with open_store() as store, ExitStack() as stack:
        found = store.resolve_session(session, tenant_id=tenant)
        bound = 2 * store.settings.rehydrate_stall_seconds if timeout is None else timeout
        deadline = time.monotonic() + bound
        handle = enqueue_rehydrate(
            found.id, tenant_id=found.tenant_id, at_seq=at_seq, format=fmt, app=queue_app(stack)
        )
        with Progress(
            console=err_console, transient=True, disable=as_json or not err_console.is_terminal
        ) as bar:
            task = bar.add_task("rehydrating", total=None)
            while True:
                try:
                    result = handle.get(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
                    break
                except NotFinishedInTime:
                    if time.monotonic() >= deadline:
                        raise NotFinishedInTime(
                            f"export of {found.id} via the queue not finished after {bound:g}s "
                            "(is a worker running? the request stays queued: an identical "
                            "one later reuses its output)"
                        ) from None
                    done = handle.progress()
                    if done is not None:
                        bar.update(task, completed=done[0], total=done[1])
                    time.sleep(0.1)
        _write_export(store, result["ref"], found.id, output)
    if as_json and output is not None:  # else stdout is the export's (as without the queue)
        print_json({**result, "path": str(output)})
    if result.get("missing_blobs"):
        from core.errors import ExportIncomplete

        raise ExportIncomplete(result["missing_blobs"], result)


def _write_export(store: SessionStore, ref: str, session_id: str, output: Path | None) -> None:
    """The output a worker built, streamed a chunk at a time (memory bounded whatever its
    size) to stdout, or to ``output``, published only once whole and checked: a stored
    output that is not what the worker wrote (``ArtifactCorrupt``, known after its last
    chunk) leaves no file, and exits 1 (on stdout, after what was written)."""
    from core.errors import ArtifactNotFound
    from core.fsio import published_bytes

    chunks = store.retrieve_chunks(ref, session_id=session_id)
    if chunks is None:
        raise ArtifactNotFound(
            f"the export {ref} of {session_id} is gone (expired or removed) before it was "
            "read; ask again"
        )
    with closing(chunks):  # its file (or S3 reader) closed however this ends
        if output is None:
            sys.stdout.flush()
            _copy(chunks, sys.stdout.buffer)
            return
        with published_bytes(output) as out:
            _copy(chunks, out)


def _copy(chunks: Iterator[bytes], out: IO[bytes]) -> None:
    for chunk in chunks:
        out.write(chunk)
    out.flush()


def _export_omp(
    session: str,
    directory: Path,
    blobs_dir: Path | None,
    at_seq: int | None,
    tenant: str | None,
    as_json: bool,
) -> None:
    from core.interop.omp import export_omp

    if blobs_dir is None:
        resolved = directory.resolve()
        in_agent = resolved.parent.name == "sessions"
        blobs_dir = resolved.parent.parent / "blobs" if in_agent else directory / "blobs"
    from core.errors import ArtifactError, ExportIncomplete

    incomplete: ExportIncomplete | None = None
    with open_store() as store:
        try:
            done = export_omp(
                store, session, directory, blobs_dir=blobs_dir, at_seq=at_seq, tenant_id=tenant
            )
        except ExportIncomplete as exc:  # written whole: reported below
            incomplete, done = exc, exc.result
    if as_json:
        print_json(done.to_dict() | ({"missing_blobs": incomplete.hashes} if incomplete else {}))
    else:
        err_console.print(
            plain(
                f"wrote {done.lines} lines to {done.session_file}, {done.artifacts} artifact(s), "
                f"{done.blobs_written} new blob(s) in {done.blobs_dir}"
            )
        )
    if incomplete is not None:
        raise incomplete  # exit 1: the session file holds refs whose blobs are not there
    if done.incomplete_artifacts:  # exit 1: outputs left out, so none passes for whole
        left_out = done.incomplete_artifacts
        shown = ", ".join(f"artifact://{i} ({state})" for i, state in left_out[:5])
        shown += ", …" if len(left_out) > 5 else ""
        raise ArtifactError(
            f"{len(left_out)} tool output(s) not exported, not whole (their "
            f"writer unfinished or dead): {shown}; `sessionstore read URL --partial` shows "
            "what was saved"
        )
