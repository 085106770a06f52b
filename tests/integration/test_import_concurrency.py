"""Several imports of one file at once (``import --watch`` in two terminals, a run over a
directory while another runs): every one succeeds, every event is appended once, and each
says honestly what it did. Both backends, real threads, each with a store of its own."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from core.interop.importer import ImportResult
from core.settings import Settings
from core.store import SessionStore
from tests.fixtures.pi.generate import v3_lines, write

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
    import core.interop.importer as importer

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
    import core.interop.importer as importer

    with SessionStore.from_settings(settings.model_copy(update={"max_batch_events": 10})) as a:
        with monkeypatch.context() as patch:  # a pass that commits its batches, not its offset
            patch.setattr(importer, "_save_offset", _raise)
            with pytest.raises(importer.ImportInterrupted):
                a.import_session(path, tenant_id=TENANT)
    with SessionStore.from_settings(settings.model_copy(update={"max_batch_events": 7})) as b:
        with monkeypatch.context() as patch:  # it looked before the other pass committed
            patch.setattr(importer, "_resumed", lambda store, session_id, entries: entries)
            found = b.import_session(path, tenant_id=TENANT)
        assert (found.appended, found.skipped) == (0, len(lines))
        events = b.read(found.session_id, rehydrate=True)
        assert [e.payload for e in events] == lines  # each once
        again = b.import_session(path, tenant_id=TENANT)
        assert (again.status, again.appended) == ("unchanged", 0)


def _raise(*args: Any, **kwargs: Any) -> None:
    raise OSError("died before it recorded its batches")
