"""Blob GC on S3 (moto server) when the object store fails or is slow midway, on both
journals: a move aside cut short, a restore over an object a writer re-created, and the
SQLite write lock never held through an S3 call (invariants 6, 12, 13)."""

from __future__ import annotations

import base64
import sqlite3
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import obstore
import pytest
from obstore.exceptions import PermissionDeniedError

from core import SessionStore
from core.blobs.objects import QUARANTINE_PREFIX, ObjectBlobStore
from core.blobs.store import make_ref, sha256_hex
from core.db import is_sqlite
from core.errors import StorageUnavailable
from core.models import BlobRow
from tests.contract.test_gc import PNG, _age

_blobs = BlobRow.__table__  # type: ignore[attr-defined]
TEXT = b"".join(b"line %d of a collectable blob\n" % i for i in range(1000))  # gzip; > 16 KiB


def _objects(store: SessionStore) -> ObjectBlobStore:
    assert isinstance(store.blobs, ObjectBlobStore)
    return store.blobs


def _registered(store: SessionStore, blob_hash: str) -> bool:
    return store.blobs.index.registered(blob_hash)


def _keys(store: SessionStore, prefix: str | None = None) -> set[str]:
    listed = obstore.list(_objects(store).store, prefix=prefix).collect()
    return {str(meta["path"]) for meta in listed}


def _failing_on(real: Callable[..., Any], nth: int) -> Callable[..., Any]:
    """``real``, except that its ``nth`` call fails as a network error would."""
    calls = [0]

    def call(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth:
            raise ConnectionError("connection reset by peer")
        return real(*args, **kwargs)

    return call


# 1. a move aside cut short ----------------------------------------------------------------


@pytest.mark.parametrize("step", ["second copy", "first delete"])
def test_a_move_aside_cut_short_keeps_the_blob_and_the_next_writer_and_gc_heal_it(
    s3_store: SessionStore, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """S3 fails inside one blob's move aside (the copy of its second codec, or the delete
    after its first copy): the run stops, the row stays (the blob stays registered), and the
    object, wherever the move left it, is put back by a read, a writer and the next GC;
    nothing referenced, or referenced since, ever loses its object."""
    blobs = _objects(s3_store)
    put = blobs.put(TEXT)
    _age(s3_store, put.hash)
    if step == "second copy":  # obstore.copy: gzip's copy succeeds, identity's fails
        monkeypatch.setattr(obstore, "copy", _failing_on(obstore.copy, 2))
    else:
        monkeypatch.setattr(obstore, "delete", _failing_on(obstore.delete, 1))
    with pytest.raises(StorageUnavailable):
        s3_store.gc_blobs(apply=True, grace=60)
    monkeypatch.undo()
    assert _registered(s3_store, put.hash)

    # A writer references it again (its bytes: the put path re-creates a missing object).
    sid = s3_store.create_session(tenant_id="acme").id
    s3_store.append(sid, [{"type": "custom", "customType": "gc", "data": TEXT.decode()}])
    report = s3_store.gc_blobs(apply=True, grace=0)  # recovery first, then the sweep
    assert report.deleted == 0 and _registered(s3_store, put.hash)
    assert _keys(s3_store, QUARANTINE_PREFIX) == set()
    assert blobs.get(put.hash) == TEXT
    assert s3_store.read(sid, rehydrate=True)[0].payload["data"] == TEXT.decode()


# 2. restoring over a re-created object --------------------------------------------------


def _corrupt_live_object(store: SessionStore, blob_hash: str) -> None:
    blobs = _objects(store)
    key = blobs.key_for(blob_hash, "gzip")
    data = obstore.get(blobs.store, key).bytes().to_bytes()
    obstore.put(blobs.store, key, data[: len(data) // 2])  # truncated: a damaged object


def test_recovery_never_overwrites_a_re_created_object_with_a_corrupt_aside(
    s3_store: SessionStore,
) -> None:
    """A damaged object is moved aside by a GC that then dies (the row stays). A writer
    puts the content again (a good object at the live key) and references it. The next
    GC's recovery must not copy the damaged aside over the good object (invariant 13: the
    blob was verified when put; a restore that destroys it loses a referenced blob)."""
    blobs = _objects(s3_store)
    put = blobs.put(TEXT)
    _corrupt_live_object(s3_store, put.hash)
    assert blobs.quarantine_file(put.hash)  # as GC does; then the "crash"

    sid = s3_store.create_session(tenant_id="acme").id
    s3_store.append(sid, [{"type": "custom", "customType": "gc", "data": TEXT.decode()}])
    assert blobs.get(put.hash) == TEXT

    s3_store.gc_blobs(apply=True, grace=3600)
    assert blobs.get(put.hash) == TEXT
    assert s3_store.read(sid, rehydrate=True)[0].payload["data"] == TEXT.decode()
    assert _keys(s3_store, QUARANTINE_PREFIX) == set()


def test_a_corrupt_aside_is_never_put_back_in_service(s3_store: SessionStore) -> None:
    """With no object at the live key, a damaged aside goes to ``corrupt/`` for inspection
    instead of back in service; a put of the content then stores it again."""
    blobs = _objects(s3_store)
    put = blobs.put(TEXT)
    _corrupt_live_object(s3_store, put.hash)
    aside = blobs.quarantine_file(put.hash)
    blobs.restore_quarantined(aside)
    assert not blobs.has_stored(put.hash)
    assert _keys(s3_store, QUARANTINE_PREFIX) == set()
    (kept,) = _keys(s3_store, "corrupt")  # for inspection, as ``blobs verify`` keeps them
    assert kept.startswith(f"corrupt/{blobs.key_for(put.hash, 'gzip')}.")
    blobs.put(TEXT)
    assert blobs.get(put.hash) == TEXT


def test_a_lookup_verifies_an_aside_before_it_takes_it_back(s3_store: SessionStore) -> None:
    """``exists`` finding only an aside takes it back as a restore does: a damaged one goes
    to ``corrupt/``, and the blob is missing, not served."""
    blobs = _objects(s3_store)
    put = blobs.put(TEXT)
    _corrupt_live_object(s3_store, put.hash)
    blobs.quarantine_file(put.hash)
    assert not blobs.exists(put.hash)
    assert _keys(s3_store, QUARANTINE_PREFIX) == set() and _keys(s3_store, "corrupt")


def test_an_intact_aside_is_put_back(s3_store: SessionStore) -> None:
    blobs = _objects(s3_store)
    put = blobs.put(TEXT)
    blobs.restore_quarantined(blobs.quarantine_file(put.hash))
    assert blobs.has_stored(put.hash) and blobs.get(put.hash) == TEXT
    assert _keys(s3_store, QUARANTINE_PREFIX) == set()


# 3. SQLite's write lock and S3 calls ----------------------------------------------------


@pytest.mark.parametrize("backend", ["sqlite"])
def test_gc_makes_no_s3_call_while_it_holds_the_sqlite_write_lock(
    s3_store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each S3 call may take the store's timeout and retry window (~50 s): made while GC
    holds SQLite's database-wide write lock, every writer waits that long, or fails as
    "database is locked". A probe at each of GC's S3 calls tries to take the lock at once."""
    assert is_sqlite(s3_store.engine)
    blobs = _objects(s3_store)
    garbage = [blobs.put(TEXT + b"%d" % i).hash for i in range(3)]
    for blob_hash in garbage:
        _age(s3_store, blob_hash)
    orphan = blobs.put(TEXT + b"orphan").hash
    with s3_store.engine.begin() as conn:
        conn.execute(_blobs.delete().where(_blobs.c.hash == orphan))
    locked_during = _probe_the_write_lock_at_each_s3_call(s3_store, monkeypatch)
    report = s3_store.gc_blobs(apply=True, grace=0)
    monkeypatch.undo()
    assert locked_during == []
    assert (report.deleted, report.orphans, report.error_count) == (3, 1, 0)
    assert not any(blobs.has_stored(h) for h in [*garbage, orphan])
    assert _keys(s3_store, QUARANTINE_PREFIX) == set()


def _probe_the_write_lock_at_each_s3_call(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    """From now on, each S3 call of the blob store first tries to take SQLite's write lock
    at once: the list collects the failures (a call made while the lock is held)."""
    path = store.engine.url.database
    assert path is not None
    locked_during: list[str] = []
    real = ObjectBlobStore._call

    def probing(self: ObjectBlobStore, call: Callable[[], Any]) -> Any:
        probe = sqlite3.connect(path, timeout=0, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
        except sqlite3.OperationalError as exc:
            locked_during.append(str(exc))
        finally:
            probe.close()
        return real(self, call)

    monkeypatch.setattr(ObjectBlobStore, "_call", probing)
    return locked_during


@pytest.mark.parametrize("backend", ["sqlite"])
def test_a_write_makes_no_s3_call_while_it_holds_the_sqlite_write_lock(
    s3_store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's side of the same: an append of new content, of content already stored,
    and of content whose object is gone (re-created), and a put of each, register their
    rows in a short transaction and check the objects after it. Fails before: every object
    was checked (HEAD, or re-created) inside the append's transaction, each writer of the
    database waiting on it."""
    blobs = _objects(s3_store)
    known = blobs.put(TEXT + b"known").hash
    gone = blobs.put(TEXT + b"gone").hash
    obstore.delete(blobs.store, [k for k in _keys(s3_store) if gone in k])
    sid = s3_store.create_session(tenant_id="acme").id
    contents = [TEXT + b"new", TEXT + b"known", TEXT + b"gone"]
    events = [{"type": "custom", "customType": "gc", "data": c.decode()} for c in contents]
    shot = PNG + b"a screenshot" + bytes(2000)
    s3_store.append(sid, [_image(base64.b64encode(shot).decode())])
    locked_during = _probe_the_write_lock_at_each_s3_call(s3_store, monkeypatch)
    s3_store.append(sid, events)
    s3_store.append(sid, [_image(make_ref(sha256_hex(shot)))])  # a producer's ref: a refresh
    puts = blobs.put_many([TEXT + b"put new", TEXT + b"known", TEXT + b"gone"])
    monkeypatch.undo()
    assert locked_during == []
    assert [r.hash for r in puts][1:] == [known, gone]
    read = s3_store.read(sid, rehydrate=True)
    assert [e.payload["data"] for e in read[1:4]] == [c.decode() for c in contents]
    assert read[4].payload["message"]["content"][0]["data"] == base64.b64encode(shot).decode()
    assert all(blobs.exists(r.hash) for r in puts)


def _image(data: str) -> dict[str, Any]:
    block = {"type": "image", "mimeType": "image/png", "data": data}
    return {"type": "message", "message": {"role": "user", "content": [block]}}


def test_gc_between_a_writes_registration_and_its_append_costs_nothing(
    s3_store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window a registration committed on its own opens (SQLite's short one, and
    PostgreSQL's, both journals): GC (a grace of 0) deletes the rows and objects a write
    has just registered, before its append commits. The append
    finds them gone (``BlobsMissing``), puts them again and commits: nothing lost."""
    blobs = _objects(s3_store)
    sid = s3_store.create_session(tenant_id="acme").id
    real = ObjectBlobStore.stage_many
    collected: list[int] = []

    def then_gc(self: ObjectBlobStore, items: Any) -> Any:
        staged = real(self, items)
        if not collected:
            collected.append(s3_store.gc_blobs(apply=True, grace=0).deleted)
        return staged

    monkeypatch.setattr(ObjectBlobStore, "stage_many", then_gc)
    s3_store.append(sid, [{"type": "custom", "customType": "gc", "data": TEXT.decode()}])
    monkeypatch.undo()
    assert collected == [1]
    assert s3_store.read(sid, rehydrate=True)[0].payload["data"] == TEXT.decode()
    assert s3_store.gc_blobs(apply=True, grace=0).deleted == 0  # referenced now
    assert blobs.exists(sha256_hex(TEXT))


def test_a_put_between_the_row_delete_and_the_purge_keeps_its_object(
    s3_store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Invariant 6 at the end of a sweep: the row delete has committed, the aside is not
    purged yet, and a writer puts the content again: it registers anew and re-creates the
    object, which the purge of the aside leaves alone."""
    blobs = _objects(s3_store)
    put = blobs.put(TEXT)
    _age(s3_store, put.hash)
    real = ObjectBlobStore.purge_quarantined

    def put_first(self: ObjectBlobStore, moved: Any) -> None:
        if moved:
            assert not _registered(s3_store, put.hash)
            self.put(TEXT)
        real(self, moved)

    monkeypatch.setattr(ObjectBlobStore, "purge_quarantined", put_first)
    assert s3_store.gc_blobs(apply=True, grace=60).deleted == 1
    monkeypatch.undo()
    assert _registered(s3_store, put.hash) and blobs.get(put.hash) == TEXT
    assert _keys(s3_store, QUARANTINE_PREFIX) == set()


@pytest.mark.parametrize("hours", [7, -7])
def test_gc_judges_an_objects_age_by_the_stores_clock(
    s3_store: SessionStore, monkeypatch: pytest.MonkeyPatch, hours: int
) -> None:
    """An object never registered (a put whose registration is still to come) is an orphan
    only once older than the grace window on the store's clock, which stamps its
    last-modified time. A GC host hours ahead of the store removed a fresh one (the put then
    re-created it, or its append failed as BlobsMissing); one hours behind kept a dead one."""
    import time

    from tests.support import skew_host_clock

    blobs = _objects(s3_store)
    orphan = blobs.put(TEXT + b"fresh orphan").hash
    with s3_store.engine.begin() as conn:
        conn.execute(_blobs.delete().where(_blobs.c.hash == orphan))
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + hours * 3600.0)
    skew_host_clock(monkeypatch, timedelta(hours=hours))
    fresh = s3_store.gc_blobs(apply=True, grace=3600)
    assert (fresh.orphans, fresh.error_count) == (0, 0) and blobs.has_stored(orphan)
    time.sleep(3)  # S3's last-modified is in whole seconds, and so is the store's clock
    due = s3_store.gc_blobs(apply=True, grace=1)
    assert (due.orphans, due.error_count) == (1, 0) and not blobs.has_stored(orphan)


def test_clock_probes_a_killed_run_left_are_removed_by_the_next_run(
    s3_store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed between its clock probe's put and delete leaves the probe behind; the
    next run's probe removes those an hour old by the store's clock (the listing's stamps,
    aged here), and only those: a younger one may be a run's still going."""
    store = _objects(s3_store).store
    obstore.put(store, ".health/clock/left-by-a-killed-run", b"")
    obstore.put(store, ".health/clock/a-run-still-going", b"")
    real = obstore.list

    class Aged:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.listed = real(*args, **kwargs).collect()

        def collect(self) -> list[Any]:
            for meta in self.listed:
                if str(meta["path"]).endswith("killed-run"):
                    meta["last_modified"] -= timedelta(hours=1, seconds=5)
            return self.listed

    def listing(*args: Any, prefix: str | None = None, **kwargs: Any) -> Any:
        if prefix == ".health/clock":
            return Aged(*args, prefix=prefix, **kwargs)
        return real(*args, prefix=prefix, **kwargs)

    monkeypatch.setattr(obstore, "list", listing)
    real_delete = obstore.delete

    def refused_for_a_list(store: Any, keys: Any) -> Any:
        if isinstance(keys, list):  # a store that refuses DeleteObjects
            raise PermissionDeniedError("403 AccessDenied")
        return real_delete(store, keys)

    with monkeypatch.context() as refusing:
        refusing.setattr(obstore, "delete", refused_for_a_list)
        tidying_refused = s3_store.gc_blobs(apply=True, grace=60)  # tidying only: no failure
    report = s3_store.gc_blobs(apply=True, grace=60)
    monkeypatch.undo()
    assert (tidying_refused.error_count, tidying_refused.complete) == (0, True)
    assert report.error_count == 0
    assert _keys(s3_store, ".health/clock") == {".health/clock/a-run-still-going"}


def test_checks_that_change_nothing_make_no_write(
    s3_store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``blobs verify``, a GC dry run and an expiry dry run with a credential that may only
    read and list: reading the store's clock (a probe object) is no reason to fail them.
    Verify needs no times; the dry runs judge by this host's clock then, with a warning.
    (The clock's probe made each of them fail, after the whole work, as unavailable.)"""
    from core.blobs.verify import verify_blobs

    blobs = _objects(s3_store)
    orphan = blobs.put(TEXT + b"a dry orphan").hash
    with s3_store.engine.begin() as conn:
        conn.execute(_blobs.delete().where(_blobs.c.hash == orphan))
    kept = blobs.put(TEXT + b"kept").hash
    writes: list[str] = []

    def refused(store: Any, key: str, *args: Any, **kwargs: Any) -> Any:
        writes.append(key)  # what a read-only credential answers
        raise PermissionDeniedError("403 AccessDenied")

    monkeypatch.setattr(obstore, "put", refused)
    monkeypatch.setattr(obstore, "delete", refused)
    report = verify_blobs(blobs)
    assert report.to_dict()["checked"] >= 1 and blobs.has_stored(kept)
    assert writes == []  # verify needs no clock
    dry = s3_store.gc_blobs(apply=False, grace=0)
    assert (dry.orphans, dry.error_count) == (1, 0)
    expiry = s3_store.expire_artifacts(apply=False)
    assert expiry.errors == []
    assert writes and all(key.startswith(".health/clock/") for key in writes)  # probes only
