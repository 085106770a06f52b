"""Several imports of one file at once (``import --watch`` in two terminals, a run over a
directory while another runs): every one succeeds, every event is appended once, and each
says honestly what it did. Both backends, real threads, each with a store of its own."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from core.errors import ImportInterrupted, StorageUnavailable
from core.interop import importer
from core.interop.importer import ImportResult
from core.settings import Settings
from core.store import SessionStore
from tests.fixtures.pi.generate import v3_lines, write
from tests.support import wait_for

TENANT = "acme"
IMPORTERS = 4


def _lines(count: int) -> list[dict[str, Any]]:
    lines = v3_lines()
    parent = lines[-1]["id"]
    for n in range(count):
        lines.append(
            {
                "type": "message",
                "id": f"m{n}",
                "parentId": parent,
                "timestamp": "2026-11-20T11:00:00.000Z",
                "message": {"role": "user", "content": "x" * 200, "timestamp": n},
            }
        )
        parent = f"m{n}"
    return lines


def _run_at_once(
    settings: Settings, path: Path, prepare: Callable[[SessionStore, threading.Barrier], None]
) -> list[ImportResult | BaseException]:
    barrier = threading.Barrier(IMPORTERS, timeout=60)
    results: list[ImportResult | BaseException] = [RuntimeError("did not run")] * IMPORTERS

    def run(n: int) -> None:
        try:
            with SessionStore.from_settings(settings) as store:
                prepare(store, barrier)
                results[n] = store.import_session(path, tenant_id=TENANT)
        except BaseException as exc:  # reported by the test
            results[n] = exc

    threads = [threading.Thread(target=run, args=(n,)) for n in range(IMPORTERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return results


def _check(store: SessionStore, results: list[Any], lines: list[dict[str, Any]]) -> None:
    assert all(isinstance(r, ImportResult) for r in results), results
    assert len({r.session_id for r in results}) == 1
    assert sum(r.appended for r in results) == len(lines)  # each event appended once
    for r in results:
        assert r.appended + r.skipped == len(lines)
        # a pass that found events no finished pass had recorded did not find it unchanged
        assert (r.status == "unchanged") == (r.appended == 0 and r.taken_up == 0)
    assert [r.status for r in results].count("created") == 1
    events = store.read(results[0].session_id, rehydrate=True)
    assert [e.payload for e in events] == lines
    again = store.import_session(results[0].path, tenant_id=TENANT)
    assert (again.status, again.appended, again.taken_up) == ("unchanged", 0, 0)


def test_first_imports_at_once_adopt_the_session_one_creates(
    settings: Settings, tmp_path: Path
) -> None:
    """Every importer looks the session up before any has created it: one creates it, the
    others (ExternalIdTaken before) continue it, its batches replayed, not doubled."""
    settings = settings.model_copy(update={"max_batch_events": 25})
    path = tmp_path / "s.jsonl"
    lines = _lines(300)
    write(path, lines)

    def all_look_first(store: SessionStore, barrier: threading.Barrier) -> None:
        real = store.journal.find_external
        calls = {"n": 0}

        def find_external(*args: Any, **kwargs: Any) -> Any:
            found = real(*args, **kwargs)
            calls["n"] += 1
            if calls["n"] == 1:
                barrier.wait()  # nobody creates before everybody has looked
            return found

        store.journal.find_external = find_external  # type: ignore[method-assign]

    results = _run_at_once(settings, path, all_look_first)
    with SessionStore.from_settings(settings) as store:
        _check(store, results, lines)


def test_imports_at_once_without_help(settings: Settings, tmp_path: Path) -> None:
    """The same, started together and left to the scheduler."""
    settings = settings.model_copy(update={"max_batch_events": 10})
    path = tmp_path / "s.jsonl"
    lines = _lines(500)
    write(path, lines)

    def start_together(store: SessionStore, barrier: threading.Barrier) -> None:
        barrier.wait()

    results = _run_at_once(settings, path, start_together)
    with SessionStore.from_settings(settings) as store:
        _check(store, results, lines)


def test_events_a_dead_pass_appended_are_taken_up_not_unchanged(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass that finds every event appended but not recorded (the pass that appended them
    died, or is still running) completes the import: it says so, not 'unchanged'."""
    path = tmp_path / "s.jsonl"
    lines = _lines(20)
    write(path, lines)

    with SessionStore.from_settings(settings) as store:
        with monkeypatch.context() as patch:

            def die(*args: Any, **kwargs: Any) -> None:
                raise OSError("died before it recorded its batches")

            patch.setattr(importer, "_save_offset", die)
            with pytest.raises(importer.ImportInterrupted):
                store.import_session(path, tenant_id=TENANT)
        found = store.import_session(path, tenant_id=TENANT)
        assert (found.status, found.appended, found.skipped, found.taken_up) == (
            "appended",
            0,
            len(lines),
            len(lines),
        )
        again = store.import_session(path, tenant_id=TENANT)
        assert (again.status, again.taken_up) == ("unchanged", 0)


def test_a_batch_a_concurrent_pass_cut_elsewhere_counts_as_imported(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's key names its first file event, so a concurrent pass with another batch
    size commits other content under the same key. Those are this file's events all the
    same: the pass counts them as a replay (not ``IdempotencyKeyReused``) and goes on."""
    path = tmp_path / "s.jsonl"
    lines = _lines(20)
    write(path, lines)

    with SessionStore.from_settings(settings.model_copy(update={"max_batch_events": 10})) as a:
        with monkeypatch.context() as patch:  # a pass that commits its batches, not its offset
            patch.setattr(importer, "_save_offset", _raise)
            with pytest.raises(importer.ImportInterrupted):
                a.import_session(path, tenant_id=TENANT)
    with SessionStore.from_settings(settings.model_copy(update={"max_batch_events": 7})) as b:
        with monkeypatch.context() as patch:  # it looked before the other pass committed
            real = importer._resumed
            looked: list[int] = []

            def resumed(store: SessionStore, session_id: str, entries: int) -> int:
                looked.append(entries)  # its first look found nothing; later ones are real
                return entries if len(looked) == 1 else real(store, session_id, entries)

            patch.setattr(importer, "_resumed", resumed)
            found = b.import_session(path, tenant_id=TENANT)
        assert (found.appended, found.skipped) == (0, len(lines))
        events = b.read(found.session_id, rehydrate=True)
        assert [e.payload for e in events] == lines  # each once
        again = b.import_session(path, tenant_id=TENANT)
        assert (again.status, again.appended) == ("unchanged", 0)


def _raise(*args: Any, **kwargs: Any) -> None:
    raise OSError("died before it recorded its batches")


# A file read by one pass (``short`` events, resuming at ``first``) while a concurrent pass
# imports it grown to ``len(_lines(GROWN))`` events, in batches of ``BATCH`` cut elsewhere.
GROWN, BATCH = 16, 10
FIRST, SHORT = len(v3_lines()) + 2, len(v3_lines()) + 7


@contextmanager
def _concurrent_pass_once(
    monkeypatch: pytest.MonkeyPatch, step: str, run: Callable[[], None]
) -> Iterator[None]:
    """Run ``run`` (another pass) once, where this pass calls ``importer.<step>``."""
    real, ran = getattr(importer, step), []

    def first_the_other(*args: Any, **kwargs: Any) -> Any:
        if not ran:
            ran.append(True)
            run()
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(importer, step, first_the_other)
        yield


@contextmanager
def _read_shorter(
    settings: Settings, path: Path
) -> Iterator[tuple[SessionStore, list[dict[str, Any]]]]:
    """A store (batches of ``BATCH``) whose session holds the first ``FIRST`` events of
    the file at ``path``, which now holds ``SHORT`` of its lines (``_lines(GROWN)``)."""
    lines = _lines(GROWN)
    with SessionStore.from_settings(settings.model_copy(update={"max_batch_events": BATCH})) as s:
        write(path, lines[:FIRST])
        s.import_session(path, tenant_id=TENANT)
        write(path, lines[:SHORT])
        yield s, lines


def _offset_entries(store: SessionStore, session_id: str) -> int:
    offset = importer._offset_of(store, session_id)
    assert offset is not None
    return offset.entries


def test_a_pass_that_read_less_and_finished_last_doubles_nothing(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass that read the shorter file finds its batch's key committed by the other's
    longer batch: it resumes after what the journal holds, leaves the other's offset as it
    is (it recorded its own over it, behind it), and the next pass appends nothing again
    (it appended the other's last batches a second time)."""
    path = tmp_path / "s.jsonl"
    with _read_shorter(settings, path) as (s, lines):
        other: list[ImportResult] = []

        def the_grown_file() -> None:
            write(path, lines)
            other.append(s.import_session(path, tenant_id=TENANT))

        with _concurrent_pass_once(monkeypatch, "_validate", the_grown_file):
            slow = s.import_session(path, tenant_id=TENANT)
        assert other[0].appended == len(lines) - FIRST
        assert (slow.appended, slow.skipped) == (0, SHORT)
        assert _offset_entries(s, slow.session_id) == len(lines)
        again = s.import_session(path, tenant_id=TENANT)
        assert (again.status, again.appended) == ("unchanged", 0)
        assert [e.payload for e in s.read(slow.session_id, rehydrate=True)] == lines


def test_an_offset_recorded_inside_a_batch_resumes_after_it(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other pass dies after its first batch: the pass that read less records its
    offset inside that batch, and the next pass resumes after the batch, not at the
    offset (which appended the rest of that batch again)."""
    path = tmp_path / "s.jsonl"
    with _read_shorter(settings, path) as (s, lines):
        real_append = s.append

        def dies_after_one_batch() -> None:
            write(path, lines)
            calls: list[int] = []

            def append(*args: Any, **kwargs: Any) -> Any:
                calls.append(1)
                if len(calls) > 1:
                    raise StorageUnavailable("database", "the pass died")
                return real_append(*args, **kwargs)

            with monkeypatch.context() as patch:
                patch.setattr(s, "append", append)
                with pytest.raises(ImportInterrupted):
                    s.import_session(path, tenant_id=TENANT)

        with _concurrent_pass_once(monkeypatch, "_validate", dies_after_one_batch):
            slow = s.import_session(path, tenant_id=TENANT)
        assert (slow.appended, slow.skipped) == (0, SHORT)
        assert FIRST < _offset_entries(s, slow.session_id) < FIRST + BATCH  # inside it
        write(path, lines)
        rest = s.import_session(path, tenant_id=TENANT)
        assert rest.appended == len(lines) - FIRST - BATCH
        assert [e.payload for e in s.read(slow.session_id, rehydrate=True)] == lines


def test_a_pass_that_read_the_file_before_another_imported_more_is_unchanged(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It finds an offset beyond its (shorter) file: every event of it is imported, which
    is no changed imported part (an ``ImportConflict`` before)."""
    path = tmp_path / "s.jsonl"
    with _read_shorter(settings, path) as (s, lines):

        def the_grown_file() -> None:
            write(path, lines)
            s.import_session(path, tenant_id=TENANT)

        with _concurrent_pass_once(monkeypatch, "_check_session_fields", the_grown_file):
            slow = s.import_session(path, tenant_id=TENANT)
        assert (slow.status, slow.appended, slow.skipped) == ("unchanged", 0, SHORT)
        assert _offset_entries(s, slow.session_id) == len(lines)
        assert [e.payload for e in s.read(slow.session_id, rehydrate=True)] == lines


# importer processes at once, each with a batch size of its own (so their batches' keys
# name the same file events with other content), and the file they follow
PROCESS_BATCHES = (5, 7, 11)
WRITTEN = 240


def _import_until_written(
    database_url: str,
    data_dir: str,
    path: str,
    batch: int,
    passes: Any,
    written: Any,
    errors: Any,
) -> None:
    """An importer process: a pass, again and again, until the writer is done; then one
    more. Each pass is counted in ``passes``; any failure is put in ``errors``."""
    settings = Settings(data_dir=data_dir, database_url=database_url, max_batch_events=batch)
    try:
        with SessionStore.from_settings(settings) as store:
            while True:
                last = written.is_set()
                store.import_session(path, tenant_id=TENANT)
                with passes.get_lock():
                    passes.value += 1
                if last:
                    return
    except BaseException as exc:
        errors.put(f"{type(exc).__name__}: {exc}")


def test_importer_processes_and_a_writer_at_once(settings: Settings, tmp_path: Path) -> None:
    """Three processes import one file over and over while it grows, a line sometimes
    written in two parts: at the end the session holds each line once, in order. The writer
    appends its next lines once a pass has run since its last ones."""
    path = tmp_path / "s.jsonl"
    lines = _lines(WRITTEN)
    write(path, lines[:1])
    context = multiprocessing.get_context("fork")
    passes, written, errors = context.Value("i", 0), context.Event(), context.Queue()
    workers = [
        context.Process(
            target=_import_until_written,
            args=(
                settings.resolved_database_url,
                str(settings.data_dir),
                str(path),
                batch,
                passes,
                written,
                errors,
            ),
        )
        for batch in PROCESS_BATCHES
    ]
    for worker in workers:
        worker.start()
    try:
        _write_in_chunks(path, lines[1:], passes)
    finally:
        written.set()
        for worker in workers:
            worker.join(120)
    assert [w.exitcode for w in workers] == [0] * len(workers)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert failures == []
    with SessionStore.from_settings(settings) as store:
        final = store.import_session(path, tenant_id=TENANT)
        assert (final.status, final.appended) == ("unchanged", 0)
        assert [e.payload for e in store.read(final.session_id, rehydrate=True)] == lines


def _write_in_chunks(path: Path, lines: list[dict[str, Any]], passes: Any) -> None:
    """Append ``lines`` in chunks of 1 to 13, the last line of every third chunk in two
    writes; each chunk once a pass has run since the last one."""
    from core.interop.pi import dumps_exact

    start, chunk = 0, 0
    with path.open("ab") as out:
        while start < len(lines):
            size = 1 + chunk * 5 % 13
            data = b"".join(dumps_exact(v).encode() + b"\n" for v in lines[start : start + size])
            cut = len(data) - 7 if chunk % 3 == 0 else len(data)
            seen = passes.value
            out.write(data[:cut])
            out.flush()
            if cut < len(data):
                seen = _after_a_pass(passes, seen)
                out.write(data[cut:])
                out.flush()
            _after_a_pass(passes, seen)
            start, chunk = start + size, chunk + 1


def _after_a_pass(passes: Any, seen: int) -> int:
    """Once the importers have run a pass more than ``seen``; how many they have run."""
    wait_for(lambda: passes.value > seen, 60, "an importer's pass", step=0.01)
    return int(passes.value)


def test_the_batch_covering_a_file_event_is_found_in_one_query(store: SessionStore) -> None:
    """Where a resume stands (``_resumed``): inside a batch, at a batch's first event, or
    after them all, each answer is one query of ``writes`` (it was two whenever the latest
    batch had not begun before the event: a first look at it, then every batch)."""
    session = store.create_session(tenant_id=TENANT)
    for start, count in ((0, 3), (3, 4), (7, 2)):
        events = [{"type": "custom", "n": start + n} for n in range(count)]
        store.append(session.id, events, idempotency_key=importer._batch_key(start))
    store.append(session.id, [{"type": "custom"}], idempotency_key="sessionstore.import:x")
    queries: list[str] = []

    @event.listens_for(store.engine, "before_cursor_execute")
    def _record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "FROM writes" in statement:
            queries.append(statement)

    found = {at: importer._covering_batch_end(store, session.id, at) for at in (1, 5, 7, 8, 9)}
    assert found == {1: 3, 5: 7, 7: None, 8: 9, 9: None}
    assert len(queries) == len(found), queries
