"""Blob GC (invariant 6): what it keeps and deletes, dry runs, the CLI, and GC racing writers.

Every test runs against real SQLite files and real PostgreSQL databases, on file:// and on
s3:// (moto server) blobs unless it inspects files; the race test runs four writer processes
against a GC loop with grace 0 on both, and then rehydrates every blob ref.
"""

from __future__ import annotations

import base64
import hashlib
import json
import multiprocessing
import os
import random
import re
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import obstore
import pytest
from sqlalchemy import delete, select, update
from sqlalchemy import event as sa_event
from sqlalchemy.exc import OperationalError

from core import InvalidEvent, SessionStore, Settings
from core.blobs.files import FileBlobStore
from core.blobs.objects import ObjectBlobStore
from core.blobs.store import sha256_hex
from core.blobs.verify import verify_blobs
from core.db import is_sqlite
from core.errors import BlobsMissing, StorageUnavailable
from core.maintenance.gc import TEMP_MIN_AGE_S, BlobGc, GcReport, GcResume
from core.models import BlobRefRow, BlobRow, utcnow
from core.records import ManifestEntry, PreparedEvent
from tests.cli_process import run_cli
from tests.support import skew_host_clock, store_env

MP = multiprocessing.get_context("spawn")
INLINE_LIMIT = 256  # small, so modest strings become blobs
GRACE = 600.0
OLD = timedelta(hours=2)
_blobs = BlobRow.__table__  # type: ignore[attr-defined]
_refs = BlobRefRow.__table__  # type: ignore[attr-defined]

RACE_SECONDS = float(os.environ.get("SESSIONSTORE_GC_RACE_SECONDS", "12"))
RACE_WRITERS = 4
RACE_WINDOW_S = 1.0  # the rotating set: which keys writers use changes every window
RACE_KEYS_PER_WINDOW = 12
# Each writer races for RACE_SECONDS and at least this many steps (at most RACE_SECONDS * 4
# more): on a loaded machine (four races at once on two cores, SQLite and S3 the slowest)
# a fixed time alone left some races with too few steps to prove anything.
RACE_MIN_STEPS = 40
# ... and until GC has collected this many blobs the writers let go (the proof that the race
# happened): under CI's load on S3 the minimum steps once left 17.
RACE_MIN_COLLECTED = 20
PNG = b"\x89PNG\r\n\x1a\n"

FILE_ONLY = pytest.mark.parametrize("blob_kind", ["file"])


@pytest.fixture(params=["file", "s3"])
def blob_kind(request: pytest.FixtureRequest) -> str:
    """Every GC test runs on both blob backends unless it names one."""
    return str(request.param)


@pytest.fixture
def gc_settings(
    database_url: str, tmp_path: Path, blob_kind: str, request: pytest.FixtureRequest
) -> Settings:
    blob_url = None
    if blob_kind == "s3":
        blob_url = f"{request.getfixturevalue('s3_bucket')}/blobs"
    return Settings(
        data_dir=tmp_path / "data",
        database_url=database_url,
        blob_url=blob_url,
        inline_string_limit=INLINE_LIMIT,
    )


@pytest.fixture
def gstore(gc_settings: Settings) -> Iterator[SessionStore]:
    with SessionStore.from_settings(gc_settings) as s:
        yield s


def _text(key: str) -> str:
    return f"blob content for {key}; " * 20  # over INLINE_LIMIT bytes


def _png(key: str) -> bytes:
    return PNG + hashlib.sha256(key.encode()).digest() * 40  # base64 > 1024 chars


def _text_event(key: str) -> dict[str, Any]:
    return {"type": "custom", "customType": "gc", "key": key, "kind": "text", "data": _text(key)}


def _image_event(key: str, data: str) -> dict[str, Any]:
    block = {"type": "image", "mimeType": "image/png", "data": data}
    return {
        "type": "message",
        "key": key,
        "kind": "image",
        "message": {"role": "user", "content": [block]},
    }


def _age(store: SessionStore, blob_hash: str, by: timedelta = OLD) -> None:
    with store.engine.begin() as conn:
        conn.execute(
            update(_blobs).where(_blobs.c.hash == blob_hash).values(last_written_at=utcnow() - by)
        )


def _age_file(path: Path, by: timedelta = OLD) -> None:
    stamp = time.time() - by.total_seconds()
    os.utime(path, (stamp, stamp))


def _file_of(store: SessionStore, blob_hash: str) -> Path | None:
    blobs = store.blobs
    assert isinstance(blobs, FileBlobStore)
    for codec in ("gzip", "identity"):
        path = blobs.path_for(blob_hash, codec)  # type: ignore[arg-type]
        if path.exists():
            return path
    return None


def _registered(store: SessionStore) -> set[str]:
    with store.engine.connect() as conn:
        return set(conn.execute(select(_blobs.c.hash)).scalars())


def _orphan(store: SessionStore, data: bytes) -> str:
    """A durable blob file whose registration never committed (a crash in between)."""
    blob_hash = store.blobs.put(data).hash
    with store.engine.begin() as conn:
        conn.execute(delete(_blobs).where(_blobs.c.hash == blob_hash))
    return blob_hash


def _temp_file(store: SessionStore, name: str, age: timedelta) -> Path:
    blobs = store.blobs
    assert isinstance(blobs, FileBlobStore)
    directory = blobs.root / "ab" / "cd"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".tmp-{name}.part"
    path.write_bytes(b"half a blob")
    _age_file(path, age)
    return path


@FILE_ONLY  # a file name on disk
def test_a_temp_file_that_cannot_go_is_reported_by_a_name_every_backend_stores(
    gstore: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stale temp file whose name is not UTF-8 (a planted one) and cannot be removed: the
    report names it with the byte as ``\\xff`` (``path_text``), as JSON the run log can
    store, not as the lone surrogate ``os.fsdecode`` reads it as."""
    stale = _temp_file(gstore, os.fsdecode(b"odd\xff"), timedelta(seconds=TEMP_MIN_AGE_S + 60))

    def refuse(root: Path, path: Path) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("core.maintenance.gc.nofollow.unlink", refuse)
    report = gstore.gc_blobs(apply=True, grace=GRACE)
    [error] = report.errors
    assert ".tmp-odd\\xff.part: cannot remove" in error and stale.exists()
    json.dumps(report.to_dict()).encode("utf-8")  # strict: no lone surrogate left


def _state(store: SessionStore) -> tuple[set[tuple[str, str]], set[tuple[str, float, int]]]:
    """Every blob row and every file under the blob root, with what GC could change."""
    with store.engine.connect() as conn:
        rows = {
            (r.hash, r.last_written_at.isoformat())
            for r in conn.execute(select(_blobs.c.hash, _blobs.c.last_written_at))
        }
    blobs = store.blobs
    assert isinstance(blobs, FileBlobStore)
    files = {
        (str(p), p.stat().st_mtime, p.stat().st_size) for p in blobs.root.rglob("*") if p.is_file()
    }
    return rows, files


# what GC keeps and deletes --------------------------------------------------------------


@FILE_ONLY  # inspects files on disk
def test_referenced_and_young_kept_old_unreferenced_and_orphans_swept(
    gstore: SessionStore,
) -> None:
    sid = gstore.create_session(tenant_id="acme").id
    gstore.append(sid, [_text_event("referenced")])
    referenced = sha256_hex(_text("referenced").encode())
    _age(gstore, referenced)
    unreferenced = gstore.blobs.put(b"old and unreferenced " * 20).hash
    _age(gstore, unreferenced)
    young = gstore.blobs.put(b"young and unreferenced " * 20).hash
    old_orphan = _orphan(gstore, b"old orphan " * 30)
    old_orphan_file = _file_of(gstore, old_orphan)
    assert old_orphan_file is not None
    _age_file(old_orphan_file)
    young_orphan = _orphan(gstore, b"young orphan " * 30)
    stale_temp = _temp_file(gstore, "stale", timedelta(seconds=TEMP_MIN_AGE_S + 60))
    # Older than the grace window, but a write may still own it: kept.
    recent_temp = _temp_file(gstore, "recent", timedelta(seconds=GRACE * 2))
    unreferenced_size = _file_of(gstore, unreferenced).stat().st_size  # type: ignore[union-attr]

    report = gstore.gc_blobs(apply=True, grace=GRACE)

    assert (report.scanned, report.referenced, report.young) == (3, 1, 1)
    assert (report.candidates, report.deleted, report.skipped) == (1, 1, 0)
    assert (report.orphans, report.temp_files, report.error_count) == (1, 1, 0)
    assert report.blob_bytes == unreferenced_size
    assert report.bytes_freed == unreferenced_size + report.orphan_bytes + len(b"half a blob")
    assert _registered(gstore) == {referenced, young}
    assert _file_of(gstore, unreferenced) is None
    assert _file_of(gstore, referenced) is not None and _file_of(gstore, young) is not None
    assert _file_of(gstore, old_orphan) is None
    assert _file_of(gstore, young_orphan) is not None
    assert not stale_temp.exists() and recent_temp.exists()
    assert gstore.read(sid, rehydrate=True)[0].payload["data"] == _text("referenced")
    again = gstore.gc_blobs(apply=True, grace=GRACE)
    assert (again.deleted, again.orphans, again.temp_files) == (0, 0, 0)


def test_orphans_are_swept_by_the_storage_time_of_their_object(gstore: SessionStore) -> None:
    """An unregistered blob has no row to date it: GC's grace reads the file's mtime, or
    the object's ``last_modified`` on S3 (set by the server; nothing in the test ages it)."""
    old = _orphan(gstore, b"orphan written before the wait " * 30)
    time.sleep(3.2)
    young = _orphan(gstore, b"orphan written just now " * 30)
    report = gstore.gc_blobs(apply=True, grace=2)
    assert (report.orphans, report.error_count) == (1, 0)
    assert not gstore.blobs.has_stored(old) and gstore.blobs.has_stored(young)


def test_default_grace_comes_from_settings(gstore: SessionStore) -> None:
    blob_hash = gstore.blobs.put(b"an hour and a bit " * 20).hash
    _age(gstore, blob_hash, timedelta(minutes=30))
    assert gstore.gc_blobs(apply=True).deleted == 0  # default grace: 3600 s
    assert gstore.gc_blobs(apply=True, grace=60).deleted == 1


SKEWED = timedelta(seconds=3 * GRACE)


@pytest.mark.parametrize("backend", ["postgres"])  # hosts share a database: PostgreSQL's
@pytest.mark.parametrize("skewed", ["writer behind", "collector ahead"])
def test_a_blobs_age_is_judged_by_the_databases_clock_whatever_the_hosts_say(
    gstore: SessionStore, skewed: str
) -> None:
    """Several hosts share the database, their clocks three grace windows apart: a blob a
    writer has just put (its event not yet appended), or has just put again (re-put or
    refreshed: dedup of a blob no event references any more), is young to GC on any host.
    Fails before: the writer's clock stamped ``last_written_at`` and GC's judged it, so all
    three were collected under the writer about to reference them."""
    old = [gstore.blobs.put(f"registered long ago {n} ".encode() * 20).hash for n in (1, 2)]
    for blob_hash in old:
        _age(gstore, blob_hash, timedelta(seconds=10 * GRACE))
    with pytest.MonkeyPatch.context() as host:
        if skewed == "writer behind":
            skew_host_clock(host, -SKEWED)
        fresh = gstore.blobs.put(b"just put, its event on the way " * 20).hash
        assert gstore.blobs.put(b"registered long ago 1 " * 20).hash == old[0]  # a re-put
        assert set(gstore.blobs.refresh([old[1]])) == {old[1]}
    with pytest.MonkeyPatch.context() as host:
        if skewed == "collector ahead":
            skew_host_clock(host, SKEWED)
        report = gstore.gc_blobs(apply=True, grace=GRACE)
    assert (report.deleted, report.young) == (0, 3), report.to_dict()
    assert _registered(gstore) == {fresh, *old}
    assert all(gstore.blobs.exists(blob_hash) for blob_hash in (fresh, *old))


@FILE_ONLY  # inspects files on disk
def test_a_collected_blob_is_put_again_by_the_next_writer(gstore: SessionStore) -> None:
    data = _text("comes back")
    blob_hash = gstore.blobs.put(data.encode()).hash
    _age(gstore, blob_hash)
    assert gstore.gc_blobs(apply=True, grace=GRACE).deleted == 1
    sid = gstore.create_session(tenant_id="acme").id
    gstore.append(sid, [_text_event("comes back")])
    assert _file_of(gstore, blob_hash) is not None
    assert gstore.read(sid, rehydrate=True)[0].payload["data"] == data


def test_pages_and_progress_cover_every_blob(gstore: SessionStore) -> None:
    hashes = [gstore.blobs.put(f"blob {i} ".encode() * 40).hash for i in range(23)]
    for h in hashes[:17]:
        _age(gstore, h)
    calls: list[tuple[str, int, int | None]] = []
    report = gstore.gc_blobs(
        apply=True, grace=GRACE, batch_size=4, progress=lambda *a: calls.append(a)
    )
    assert (report.scanned, report.candidates, report.deleted, report.young) == (23, 17, 17, 6)
    blob_ticks = [(done, total) for phase, done, total in calls if phase == "blobs"]
    assert blob_ticks[0] == (0, 23) and blob_ticks[-1] == (23, 23)
    assert [d for d, _ in blob_ticks] == sorted(d for d, _ in blob_ticks)
    assert {phase for phase, *_ in calls} == {"blobs", "files"}
    assert _registered(gstore) == set(hashes[17:])


# the sweep re-checks under the lock -----------------------------------------------------


def test_a_candidate_referenced_after_the_scan_is_kept(gstore: SessionStore) -> None:
    """The scan saw it unreferenced; a writer referenced it before the sweep locked it."""
    data = _text("late ref").encode()
    put = gstore.blobs.put(data)
    _age(gstore, put.hash)
    gc = BlobGc(gstore.engine, gstore.blobs, apply=True, grace_s=GRACE)
    page = gc.scan_page("")
    assert [c.hash for c in page.candidates] == [put.hash]
    # A journal-level append adds the ref without refreshing last_written_at, so only the
    # reference re-check can save the blob.
    sid = gstore.create_session(tenant_id="acme").id
    entry = ManifestEntry("/data", put.hash, put.size, "utf8")
    gstore.journal.append(
        sid, [PreparedEvent("custom", {"type": "custom", "data": put.ref}, (entry,))]
    )

    gc.sweep(page.candidates)

    assert (gc.report.deleted, gc.report.skipped) == (0, 1)
    assert gstore.read(sid, rehydrate=True)[0].payload["data"] == data.decode()


def test_a_candidate_put_again_after_the_scan_is_kept(gstore: SessionStore) -> None:
    data = b"refreshed " * 40
    blob_hash = gstore.blobs.put(data).hash
    _age(gstore, blob_hash)
    gc = BlobGc(gstore.engine, gstore.blobs, apply=True, grace_s=GRACE)
    page = gc.scan_page("")
    gstore.blobs.put(data)  # a re-put restarts the grace window
    gc.sweep(page.candidates)
    assert (gc.report.deleted, gc.report.skipped) == (0, 1)
    assert gstore.blobs.get(blob_hash) == data


@pytest.mark.parametrize("when", ["before the file moves", "after the file moved"])
def test_a_put_during_the_locked_removal_waits_and_recreates_the_blob(
    gstore: SessionStore, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """Invariant 6, deterministically: a writer puts the blob while GC holds its row lock and
    is removing its file. The put cannot finish until GC commits, and then the blob is
    stored again, file and row, never a row naming a removed file. (A GC that removed the
    file after its commit, without the lock, was caught only by the random racing test.)
    On SQLite with S3 no lock is held while the object moves (SQLite's is the whole
    database's): the put does not wait, and GC, re-checking after the move, keeps it."""
    moves_first = gstore.blobs.remote and is_sqlite(gstore.engine)
    data = b"put again mid-removal " * 30
    blob_hash = gstore.blobs.put(data).hash
    _age(gstore, blob_hash)
    gc = BlobGc(gstore.engine, gstore.blobs, apply=True, grace_s=GRACE)
    page = gc.scan_page("")
    real = type(gstore.blobs).quarantine_file
    writers: list[threading.Thread] = []
    finished_while_held: list[bool] = []

    def put_meanwhile() -> None:
        writer = threading.Thread(target=gstore.blobs.put, args=(data,))
        writers.append(writer)
        writer.start()
        writer.join(timeout=1.0)  # long enough to finish, were it not held back
        finished_while_held.append(not writer.is_alive())

    def quarantine(self: Any, hash_: str) -> list[Path]:
        if when == "before the file moves":
            put_meanwhile()
        moved = real(self, hash_)
        if when == "after the file moved":
            put_meanwhile()
        return moved

    monkeypatch.setattr(type(gstore.blobs), "quarantine_file", quarantine)
    gc.sweep(page.candidates)
    assert writers and finished_while_held == [moves_first]
    writers[0].join(timeout=30)
    assert not writers[0].is_alive()
    assert gc.report.deleted == (0 if moves_first else 1)
    assert blob_hash in _registered(gstore) and gstore.blobs.get(blob_hash) == data


def test_an_orphan_registered_after_the_scan_is_kept(gstore: SessionStore) -> None:
    data = b"orphan no more " * 30
    blob_hash = _orphan(gstore, data)
    gc = BlobGc(gstore.engine, gstore.blobs, apply=True, grace_s=0)
    gstore.blobs.put(data)  # registered between the scan and the removal
    assert gc._remove_orphan(blob_hash) is False
    assert gstore.blobs.get(blob_hash) == data and blob_hash in _registered(gstore)


@pytest.mark.postgres
@pytest.mark.parametrize("backend", ["postgres"])
def test_gc_skips_a_blob_an_append_holds_and_never_waits(gstore: SessionStore) -> None:
    blob_hash = gstore.blobs.put(b"held by a writer " * 20).hash
    _age(gstore, blob_hash)
    with gstore.engine.connect() as writer, writer.begin():
        # What Journal._require_blobs does inside an append, until the append commits.
        writer.execute(
            select(_blobs.c.hash).where(_blobs.c.hash == blob_hash).with_for_update(read=True)
        )
        started = time.monotonic()
        report = gstore.gc_blobs(apply=True, grace=GRACE)
        assert time.monotonic() - started < 5
    assert (report.candidates, report.deleted, report.skipped) == (1, 0, 1)
    assert gstore.gc_blobs(apply=True, grace=GRACE).deleted == 1  # released: collected


# dry runs --------------------------------------------------------------------------------


def _mixed_store(store: SessionStore) -> None:
    """Referenced, unreferenced old and young blobs, orphans and temp files, over pages."""
    sid = store.create_session(tenant_id="acme").id
    store.append(sid, [_text_event(f"ref {i}") for i in range(6)])
    for i in range(6):
        _age(store, sha256_hex(_text(f"ref {i}").encode()))
    for i in range(14):
        blob_hash = store.blobs.put(f"loose {i} ".encode() * 30).hash
        if i % 3:
            _age(store, blob_hash)
    for i in range(3):
        path = _file_of(store, _orphan(store, f"orphan {i} ".encode() * 30))
        assert path is not None
        _age_file(path)
    _temp_file(store, "stale", timedelta(seconds=TEMP_MIN_AGE_S * 2))


@FILE_ONLY  # inspects files on disk
def test_dry_run_changes_nothing_and_predicts_apply(gstore: SessionStore) -> None:
    _mixed_store(gstore)
    before = _state(gstore)
    dry = gstore.gc_blobs(grace=GRACE, batch_size=5)
    assert _state(gstore) == before
    assert not dry.applied and dry.would_delete == dry.deleted == 9
    assert (dry.orphans, dry.temp_files) == (3, 1)

    applied = gstore.gc_blobs(apply=True, grace=GRACE, batch_size=5)

    assert applied.counts() == dry.counts()
    assert applied.to_dict()["deleted"] == dry.to_dict()["would_delete"]
    rows_after, files_after = _state(gstore)
    assert len(before[0]) - len(rows_after) == 9
    assert len(before[1]) - len(files_after) == 9 + 3 + 1


def _cli(settings: Settings, *argv: str) -> subprocess.CompletedProcess[str]:
    env = store_env(settings, SESSIONSTORE_INLINE_STRING_LIMIT=str(INLINE_LIMIT), COLUMNS="200")
    return run_cli(*argv, env=env)


def _comparable(report: dict[str, Any]) -> dict[str, Any]:
    drop = {"applied", "cutoff", "seconds", "phase_seconds"}
    out = {k: v for k, v in report.items() if k not in drop}
    out["deleted"] = out.pop("deleted", None) or out.pop("would_delete", None)
    return out


@FILE_ONLY  # inspects files on disk
def test_cli_dry_run_then_apply(gstore: SessionStore, gc_settings: Settings) -> None:
    _mixed_store(gstore)
    before = _state(gstore)
    human = _cli(gc_settings, "gc", "--grace", str(GRACE))
    assert human.returncode == 0, human.stderr
    assert "would_delete" in human.stdout and "dry run: nothing was deleted" in human.stdout
    dry = _cli(gc_settings, "gc", "--grace", str(GRACE), "--json", "--batch-size", "4")
    assert dry.returncode == 0, dry.stderr
    assert _state(gstore) == before

    applied = _cli(gc_settings, "gc", "--grace", str(GRACE), "--json", "--apply")

    assert applied.returncode == 0, applied.stderr
    dry_report, applied_report = json.loads(dry.stdout), json.loads(applied.stdout)
    assert dry_report["would_delete"] == 9 and not dry_report["applied"]
    assert applied_report["deleted"] == 9 and applied_report["applied"]
    assert _comparable(dry_report) == _comparable(applied_report)
    assert len(before[0]) - len(_state(gstore)[0]) == 9


# GC racing writers ------------------------------------------------------------------------


def _race_key(rng: random.Random) -> str:
    return f"{int(time.time() / RACE_WINDOW_S)}-{rng.randrange(RACE_KEYS_PER_WINDOW)}"


def _race_step(store: SessionStore, sid: str, rng: random.Random, stats: Counter[str]) -> None:
    """One writer action on a key of the current window: put only (a GC candidate until
    someone references it), or an append that puts and references the same content."""
    key = _race_key(rng)
    action = rng.randrange(5)
    if action == 0:
        store.blobs.put(_text(key).encode())
    elif action == 1:
        store.blobs.put(_png(key))
    elif action == 2:
        store.append(sid, [_text_event(key)])
    elif action == 3:
        store.append(sid, [_image_event(key, base64.b64encode(_png(key)).decode())])
    else:  # the producer puts the image and sends its ref
        store.append(sid, [_image_event(key, store.blobs.put(_png(key)).ref)])
    stats[f"action{action}"] += 1


def _race_writer(settings_json: str, stop_at: float, results: Any, collected: Any) -> None:
    settings = Settings.model_validate_json(settings_json)
    stats: Counter[str] = Counter()
    errors: list[str] = []
    with SessionStore.from_settings(settings) as store:
        sid = store.create_session(tenant_id="race").id
        rng = random.Random(os.getpid())
        steps = 0
        hard_stop = stop_at + RACE_SECONDS * 4
        while time.time() < stop_at or (
            (steps < RACE_MIN_STEPS or collected.value < RACE_MIN_COLLECTED)
            and time.time() < hard_stop
        ):
            steps += 1
            try:
                _race_step(store, sid, rng, stats)
            except BlobsMissing:
                stats["gave_up_after_reputs"] += 1  # nothing was written: not a loss
            except InvalidEvent as exc:
                if "which is not stored" not in exc.message:
                    errors.append(repr(exc))
                stats["producer_ref_collected"] += 1  # GC took it before the append
            except Exception as exc:
                errors.append(repr(exc))
    results.put((sid, dict(stats), errors))


def _gc_loop(
    store: SessionStore, stop: threading.Event, totals: Counter[str], collected: Any
) -> None:
    # On SQLite a GC run holds the database's write lock; run back to back, it starved the
    # writers (SQLite's busy handler polls, the loop re-takes the lock at once). A beat
    # schedule runs GC every few minutes: a short pause keeps the race, not the starvation.
    pause = 0.05 if is_sqlite(store.engine) else 0.0
    while not stop.is_set():
        report: GcReport = store.gc_blobs(apply=True, grace=0)
        totals["runs"] += 1
        for key in ("deleted", "skipped", "orphans", "error_count"):
            totals[key] += getattr(report, key)
        collected.value = totals["deleted"]
        stop.wait(pause)


def _missing_refs(store: SessionStore, session_ids: list[str]) -> list[str]:
    """Every manifest row must rehydrate to the value its writer sent."""
    problems: list[str] = []
    for sid in session_ids:
        for event in store.read(sid, rehydrate=True):
            key, payload = event.payload["key"], event.payload
            if payload["kind"] == "text":
                ok = payload["data"] == _text(key)
            else:
                expected = base64.b64encode(_png(key)).decode()
                ok = payload["message"]["content"][0]["data"] == expected
            if not ok:
                problems.append(f"{sid}#{event.seq} ({key}) did not rehydrate")
    with store.engine.connect() as conn:
        referenced = list(conn.execute(select(_refs.c.hash).distinct()).scalars())
    registered = _registered(store)
    for blob_hash in referenced:
        if blob_hash not in registered or not store.blobs.has_stored(blob_hash):
            problems.append(f"blob {blob_hash} is referenced but missing")
    return problems


@pytest.mark.slow
@pytest.mark.timeout(RACE_SECONDS * 6 + 240)
def test_gc_racing_writers_loses_nothing(gstore: SessionStore, gc_settings: Settings) -> None:
    stop_at = time.time() + RACE_SECONDS
    results = MP.Queue()
    collected = MP.Value("i", 0)  # blobs GC has deleted so far: the writers read it
    writers = [
        MP.Process(
            target=_race_writer,
            args=(gc_settings.model_dump_json(), stop_at, results, collected),
        )
        for _ in range(RACE_WRITERS)
    ]
    totals: Counter[str] = Counter()
    stop = threading.Event()
    for w in writers:
        w.start()
    gc_thread = threading.Thread(target=_gc_loop, args=(gstore, stop, totals, collected))
    gc_thread.start()
    try:
        outcomes = [results.get(timeout=RACE_SECONDS * 5 + 120) for _ in writers]
    finally:
        stop.set()
        gc_thread.join(timeout=120)
        for w in writers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
    stats = sum((Counter(s) for _, s, _ in outcomes), Counter())
    print(f"\nGC race: gc={dict(totals)} writers={dict(stats)}")
    assert [e for _, _, errs in outcomes for e in errs] == []
    assert totals["error_count"] == 0
    # The race really happened: GC ran often and collected blobs writers kept putting.
    assert totals["runs"] >= 5 and totals["deleted"] >= RACE_MIN_COLLECTED
    assert stats["action2"] + stats["action3"] + stats["action4"] >= 50
    gstore.gc_blobs(apply=True, grace=0)  # a last pass with no writer left
    assert _missing_refs(gstore, [sid for sid, _, _ in outcomes]) == []


def test_race_check_detects_a_missing_blob(gstore: SessionStore) -> None:
    """The race test's verification itself can fail: remove a referenced blob's file (or
    object, through the S3 API)."""
    sid = gstore.create_session(tenant_id="acme").id
    gstore.append(sid, [_text_event("k")])
    blob_hash = sha256_hex(_text("k").encode())
    if isinstance(gstore.blobs, FileBlobStore):
        path = _file_of(gstore, blob_hash)
        assert path is not None
        path.unlink()
    else:
        blobs = gstore.blobs
        assert isinstance(blobs, ObjectBlobStore)
        keys = [blobs.key_for(blob_hash, codec) for codec in ("gzip", "identity")]
        obstore.delete(blobs.store, keys)  # S3 deletes of absent keys succeed
        assert not blobs.has_stored(blob_hash)
    assert len(_missing_refs(gstore, [sid])) == 2


@FILE_ONLY  # inspects files on disk
def test_a_gc_that_dies_before_its_commit_never_costs_a_registered_blob_its_file(
    gstore: SessionStore,
) -> None:
    """Invariant 6 across a crash: GC moves files aside under the row lock and deletes them
    only after the row delete commits. Here the run 'dies' in between: the rows are back
    (rolled back), and the files must come back too: on read, and at the next GC."""
    blobs = gstore.blobs
    assert isinstance(blobs, FileBlobStore)
    read_back, healed = b"read after an interrupted gc " * 40, b"healed by the next gc " * 40
    r1, r2 = blobs.put(read_back), blobs.put(healed)
    moved = blobs.quarantine_file(r1.hash) + blobs.quarantine_file(r2.hash)
    assert len(moved) == 2 and not blobs.path_for(r1.hash, r1.codec).exists()
    # (the killed GC's transaction rolled back: both rows are still registered)

    assert blobs.get(r1.hash) == read_back  # a read puts the file back
    assert blobs.path_for(r1.hash, r1.codec).exists()

    report = gstore.gc_blobs(apply=True, grace=3600)  # recovery runs first; both are young
    assert report.deleted == 0
    assert blobs.path_for(r2.hash, r2.codec).exists() and blobs.get(r2.hash) == healed
    assert list(blobs.iter_quarantined()) == []


@pytest.mark.parametrize("asks", ["exists", "has_stored", "blobs verify"])
def test_a_blob_a_dead_gc_left_aside_is_taken_back_when_asked_for(
    gstore: SessionStore, asks: str
) -> None:
    """A GC that died between moving a blob aside and deleting its row left it in the aside
    area (``*.gc`` beside it on disk, ``.gc/`` on S3), its row registered: the first
    lookup takes it back (on S3 verified first, as a restore is), on either backend. On S3
    ``exists``, ``has_stored`` and ``blobs verify`` called it missing until a read healed
    it."""
    blobs = gstore.blobs
    content = b"a blob whose gc died halfway " * 40
    put = blobs.put(content)
    assert blobs.quarantine_file(put.hash)  # the GC's row delete never committed
    assert [h for h, _ in blobs.iter_quarantined()] == [put.hash]
    if asks == "exists":
        assert blobs.exists(put.hash)
    elif asks == "has_stored":
        assert blobs.has_stored(put.hash)
    else:
        report = verify_blobs(blobs)
        assert (report.counts.get("missing", 0), report.ok) == (0, 1)
    assert list(blobs.iter_quarantined()) == []
    assert blobs.get(put.hash) == content


@FILE_ONLY  # inspects files on disk
def test_a_quarantined_file_whose_row_was_deleted_is_purged(gstore: SessionStore) -> None:
    blobs = gstore.blobs
    assert isinstance(blobs, FileBlobStore)
    result = blobs.put(b"garbage whose row delete committed " * 30)
    moved = blobs.quarantine_file(result.hash)
    with gstore.engine.begin() as conn:
        conn.execute(delete(BlobRow).where(BlobRow.hash == result.hash))  # type: ignore[arg-type]
    gstore.gc_blobs(apply=True, grace=0)
    assert not moved[0].exists() and not blobs.path_for(result.hash, result.codec).exists()


@FILE_ONLY  # inspects files on disk
def test_a_failed_row_delete_puts_the_files_back(gstore: SessionStore) -> None:
    blobs = gstore.blobs
    assert isinstance(blobs, FileBlobStore)
    result = blobs.put(b"collectable " * 50)

    @sa_event.listens_for(gstore.engine, "before_cursor_execute")
    def _fail_row_delete(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("DELETE FROM BLOBS"):
            raise RuntimeError("the row delete failed")

    with pytest.raises(RuntimeError):
        BlobGc(gstore.engine, blobs, apply=True, grace_s=0, batch_size=10).run()
    assert blobs.path_for(result.hash, result.codec).exists()  # moved aside, then put back
    assert blobs.get(result.hash) == b"collectable " * 50
    assert list(blobs.iter_quarantined()) == []


def test_an_unavailable_blob_store_stops_the_run_at_once(
    gstore: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 down mid-run: one failed removal ends the run, and what it did is reported,
    instead of each further candidate waiting out the store's retries inside the sweep's
    transaction (the rows' locks; on SQLite, every writer's). Down from the start, the run
    raises the typed error (nothing to report)."""
    hashes = sorted(gstore.blobs.put(_text(f"down-{i}").encode()).hash for i in range(5))
    for blob_hash in hashes:
        _age(gstore, blob_hash)
    real = gstore.blobs.quarantine_file
    tried: list[str] = []

    def unavailable_after_one(blob_hash: str) -> list[Path]:
        tried.append(blob_hash)
        if len(tried) > 1:
            raise StorageUnavailable("blobs", "blobs is unavailable: connection refused")
        return real(blob_hash)

    with monkeypatch.context() as down:
        down.setattr(gstore.blobs, "quarantine_file", unavailable_after_one)
        report = gstore.gc_blobs(apply=True, grace=60)
    assert len(tried) == 2
    assert (report.deleted, report.complete, report.unavailable) == (1, False, "blobs")
    assert any("run stopped" in e for e in report.errors), report.errors
    assert set(hashes[1:]) <= _registered(gstore) and hashes[0] not in _registered(gstore)
    with monkeypatch.context() as down:
        down.setattr(gstore.blobs, "quarantine_file", unavailable_after_one)
        with pytest.raises(StorageUnavailable):
            gstore.gc_blobs(apply=True, grace=60)
    assert len(tried) == 3
    assert gstore.gc_blobs(apply=True, grace=60).deleted == 4  # the next run collects them


def test_a_blob_store_listing_that_fails_ends_the_run_with_its_report(
    gstore: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    garbage = gstore.blobs.put(_text("listed").encode()).hash
    _age(gstore, garbage)

    def unavailable(self: Any, after: str) -> Any:
        raise StorageUnavailable("blobs", "blobs is unavailable: connection refused")

    monkeypatch.setattr(BlobGc, "_files", unavailable)
    report = gstore.gc_blobs(apply=True, grace=60)  # returns, does not raise
    assert report.deleted == 1 and not report.complete  # what was done is reported
    assert any("run stopped" in e for e in report.errors), report.errors
    assert report.resume == GcResume("files", "")  # the blobs are done: the files next


def test_a_file_walk_an_error_stops_keeps_its_place(
    gstore: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error mid-walk (the database away) ended the run without a resume point, so the
    next run walked every file again: one error per run starved the walk as a budget did."""
    for i in range(5):
        gstore.blobs.put(_text(f"walked {i}").encode())
    calls = [0]
    real_lookup = BlobGc._registered_among

    def failing_lookup(self: BlobGc, hashes: set[str]) -> set[str]:
        calls[0] += 1
        if calls[0] == 3:
            raise OperationalError("SELECT", {}, Exception("server closed the connection"))
        return real_lookup(self, hashes)

    monkeypatch.setattr(BlobGc, "_registered_among", failing_lookup)
    report = gstore.gc_blobs(apply=True, grace=60, batch_size=2)
    assert not report.complete and report.unavailable == "database"
    assert report.resume is not None and report.resume.phase == "files"
    keys = sorted(f"{h[:2]}/{h[2:4]}/{h}" for h in _registered(gstore))
    assert report.resume.after.startswith(keys[3])  # two chunks of two walked: the third not


def test_gc_with_the_database_away_from_the_start_reports_it(tmp_path: Path) -> None:
    """The database's clock is read in the run, where a database away is reported (the
    report's ``unavailable``), as it is mid-run; not raised as the driver's error."""
    settings = Settings(
        data_dir=tmp_path / "data", database_url="postgresql+psycopg://postgres@127.0.0.1:1/x"
    )
    with SessionStore.from_settings(settings) as store:
        report = store.gc_blobs(apply=False)
    assert not report.complete and report.unavailable == "database"


def test_an_omp_export_names_only_blobs_the_manifest_keeps(gstore: SessionStore) -> None:
    """oh-my-pi externalizes more images than the journal (``frames`` here): a rehydrated
    omp export keeps those inline, and refs only the blobs the session's manifest names,
    which GC keeps for as long as the session, and a tenant's resolve finds. Before, the
    export stored the others as blobs of their own that nothing referenced: GC collected
    them while the export was still served."""
    from core.interop.rehydrated import Request, rehydrate

    content_png, frame_png = _png("content"), _png("frame")
    frame_data = base64.b64encode(frame_png).decode()
    sid = gstore.create_session(tenant_id="acme").id
    block = {"type": "image", "data": base64.b64encode(content_png).decode()}
    message = {
        "role": "user",
        "content": [{**block, "mimeType": "image/png"}],
        "frames": [{"type": "image", "data": frame_data, "mimeType": "image/png"}],
    }
    entry = {"type": "message", "id": "u1", "parentId": None, "message": message}
    gstore.append(sid, [{**entry, "timestamp": "2026-11-27T10:00:00.000Z"}])
    result = rehydrate(gstore, Request(sid, "acme", "omp"))
    text = gstore.retrieve(result["ref"], session_id=sid)
    assert text is not None
    named = set(re.findall(r"blob:sha256:([0-9a-f]{64})", text))
    assert named == {sha256_hex(content_png)}
    assert frame_data in text  # inline, as the journal keeps it
    for blob_hash in _registered(gstore):
        _age(gstore, blob_hash)
    gstore.gc_blobs(apply=True, grace=60)
    for blob_hash in named:
        assert gstore.blobs.get(blob_hash) == content_png
        assert gstore.resolve(f"blob:sha256:{blob_hash}", session_id=sid) is not None


def _text_with_hash(prefix_range: str, start: int) -> tuple[str, int]:
    """A blob text (and the next counter) whose sha256 starts with a character of
    ``prefix_range``: the test decides where blobs fall in hash order."""
    i = start
    while True:
        text = _text(f"ordered-{i}")
        if sha256_hex(text.encode())[0] in prefix_range:
            return text, i + 1
        i += 1


def _budgeted_runs(
    gstore: SessionStore,
    monkeypatch: pytest.MonkeyPatch,
    costly: str,
    until: Callable[[GcReport], bool],
    **options: Any,
) -> list[GcReport]:
    """Up to four applied runs, each resuming where the last stopped, on a clock of GC's
    own that moves one "second" per call of ``BlobGc.<costly>`` and nowhere else."""
    clock = [0.0]
    real = getattr(BlobGc, costly)

    def timed(self: BlobGc, *args: Any) -> Any:
        clock[0] += 1.0
        return real(self, *args)

    monkeypatch.setattr(BlobGc, costly, timed)
    monkeypatch.setattr("core.maintenance.gc._monotonic", lambda: clock[0])
    reports: list[GcReport] = []
    resume = None
    for _ in range(4):
        report = gstore.gc_blobs(apply=True, resume=resume, **options)
        reports.append(report)
        resume = report.resume
        if until(report):
            break
    return reports


def test_a_budgeted_run_resumes_where_the_last_one_stopped(
    gstore: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store too big for one run's budget: each run goes on from where the last stopped
    (its report's ``resume``), so garbage late in hash order, and the files phase, are
    reached; before, every run scanned the same first blobs again and stopped there."""
    sid = gstore.create_session(tenant_id="acme").id
    counter = 0
    for _ in range(15):  # referenced blobs, all early in hash order: kept, but scanned
        text, counter = _text_with_hash("01234567", counter)
        gstore.append(sid, [{"type": "custom", "customType": "gc", "data": text}])
    garbage_text, counter = _text_with_hash("89abcdef", counter)
    garbage = gstore.blobs.put(garbage_text.encode()).hash
    for blob_hash in _registered(gstore):
        _age(gstore, blob_hash)
    # a page scan costs one "second"; the budget is 2.5: three pages a run
    reports = _budgeted_runs(
        gstore,
        monkeypatch,
        "scan_page",
        lambda r: r.complete,
        grace=60,
        batch_size=5,
        time_budget_s=2.5,
    )
    first = reports[0]
    assert (first.scanned, first.deleted, first.complete) == (15, 0, False)
    assert first.resume is not None and first.resume.phase == "blobs"
    assert garbage not in _registered(gstore)
    assert sum(r.deleted for r in reports) == 1
    assert reports[-1].complete and reports[-1].resume is None
    assert "resume" in first.to_dict() and first.to_dict()["resume"]["phase"] == "blobs"


def test_a_file_walk_longer_than_the_budget_goes_on_where_it_stopped(
    gstore: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files had no cursor: a walk longer than one run's budget started over each
    run, so an orphan late in key order was never reached (S3 with millions of keys).
    Walked in key order, the files resume after the last key swept, as the blobs do."""
    sid = gstore.create_session(tenant_id="acme").id
    counter = 0
    for _ in range(6):  # registered blob files, early in key order: walked, kept
        text, counter = _text_with_hash("01234567", counter)
        gstore.append(sid, [{"type": "custom", "customType": "gc", "data": text}])
    late, counter = _text_with_hash("89abcdef", counter)
    orphan = _orphan(gstore, late.encode())
    time.sleep(1.1)  # the orphan's storage time is before the run's (grace 0)
    # a chunk of files costs one "second" (its lookup); the budget, 1.5: two chunks a run
    reports = _budgeted_runs(
        gstore,
        monkeypatch,
        "_registered_among",
        lambda r: r.orphans > 0,
        grace=0,
        batch_size=2,
        time_budget_s=1.5,
    )
    first = reports[0]
    assert first.resume is not None and first.resume.phase == "files"
    assert first.resume.after.startswith(("0", "1", "2", "3", "4", "5", "6", "7"))
    assert GcResume.from_report(first.to_dict()) == first.resume  # as the beat reads it
    assert [r.orphans for r in reports] == [0, 1]  # the second run went on from there
    assert not gstore.blobs.has_stored(orphan)
    assert len(gstore.read(sid, rehydrate=True)) == 6


@pytest.mark.parametrize(
    "after",
    ["", "ab/cd/" + "a" * 64 + ".blob", "ab/cd/.tmp-x\\xff.part"],
)
def test_a_files_resume_point_reads_back(after: str) -> None:
    report = {"resume": {"phase": "files", "after": after}}
    assert GcResume.from_report(report) == GcResume("files", after)


@pytest.mark.parametrize("after", ["../../etc", "ab/cd", "xy/cd/name", "ab/cd/x/y", 7])
def test_a_files_resume_point_that_is_no_key_starts_over(after: Any) -> None:
    assert GcResume.from_report({"resume": {"phase": "files", "after": after}}) is None


def test_an_omp_export_refs_an_image_data_url_the_manifest_names(gstore: SessionStore) -> None:
    """The data-URL side of the same rule: the journal externalizes every image data URL
    (as UTF-8 text), so the export refs it by that same hash, and the ref resolves after
    GC, with the data URL's text."""
    from core.interop.rehydrated import Request, rehydrate

    url = "data:image/png;base64," + base64.b64encode(_png("url")).decode()
    sid = gstore.create_session(tenant_id="acme").id
    message = {"role": "user", "content": [{"type": "image_url", "image_url": url}]}
    entry = {"type": "message", "id": "u1", "parentId": None, "message": message}
    gstore.append(sid, [{**entry, "timestamp": "2026-11-27T10:00:00.000Z"}])
    text = gstore.retrieve(rehydrate(gstore, Request(sid, "acme", "omp"))["ref"], session_id=sid)
    assert text is not None and url not in text
    assert set(re.findall(r"blob:sha256:([0-9a-f]{64})", text)) == {sha256_hex(url.encode())}
    for blob_hash in _registered(gstore):
        _age(gstore, blob_hash)
    gstore.gc_blobs(apply=True, grace=60)
    assert gstore.blobs.get(sha256_hex(url.encode())) == url.encode()
