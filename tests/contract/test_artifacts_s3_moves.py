"""Moves and deletes with artifacts on file:// and s3:// (moto server), and a crash
mid-move on S3 repaired from the intent record: completed or rolled back, nothing lost."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest

from core import SessionStore
from core.artifacts.paths import oversized_name, session_dir
from core.artifacts.storage import key_of, key_prefix_of
from core.errors import SessionMoving
from core.sessions.object_moves import MARKER, ObjectMove
from tests.contract.artifact_backends import RawArtifacts, artifact_backend, raw, settings

__all__ = ["artifact_backend", "raw", "settings"]

S3_ONLY = pytest.mark.parametrize("artifact_backend", ["s3"])
POSTGRES = pytest.mark.parametrize("backend", ["postgres"])


def _session_with_outputs(store: SessionStore, n: int = 3) -> tuple[str, list[str]]:
    sid = store.create_session(tenant_id="acme").id
    ids = []
    for i in range(n):
        stored = store.store_oversized(sid, f"output {i} " * 2000, "bash")
        assert stored is not None
        ids.append(stored.ref.artifact_id)
    return sid, ids


def _texts(store: SessionStore, sid: str, ids: list[str]) -> list[str | None]:
    return [store.retrieve(a, session_id=sid) for a in ids]


def test_move_takes_the_objects_along_and_delete_removes_them(
    store: SessionStore, raw: RawArtifacts
) -> None:
    sid, ids = _session_with_outputs(store)
    before = _texts(store, sid, ids)
    old_dir = session_dir(raw.root, "acme", sid)
    assert len(raw.keys_under(old_dir)) == 3
    store.move(sid, tenant_id="globex")
    new_dir = session_dir(raw.root, "globex", sid)
    assert raw.keys_under(old_dir) == [] and len(raw.keys_under(new_dir)) == 3
    assert _texts(store, sid, ids) == before
    store.delete_session(sid)
    assert raw.keys_under(new_dir) == []


def _half_move(store: SessionStore, raw: RawArtifacts, sid: str, *, finish_copy: bool) -> None:
    """What a worker killed mid-move leaves: the intent row, and the objects part-way."""
    moves = store._moves
    moves._record_intent(sid, "globex", None)
    source = session_dir(raw.root, "acme", sid)
    target = session_dir(raw.root, "globex", sid)
    keys = raw.storage.keys(key_prefix_of(raw.root, source))
    src, dst = key_prefix_of(raw.root, source), key_prefix_of(raw.root, target)
    copied = keys if finish_copy else keys[:1]
    for key in copied:
        raw.storage.copy(key, dst + key[len(src) :])
    if finish_copy:  # copy done, marker written, killed after deleting one source object
        raw.storage.put(key_of(raw.root, target / ".tmp" / MARKER), b"")
        raw.storage.delete(keys[0])


@S3_ONLY
@POSTGRES
def test_crash_mid_copy_rolls_back(store: SessionStore, raw: RawArtifacts) -> None:
    sid, ids = _session_with_outputs(store)
    before = _texts(store, sid, ids)
    _half_move(store, raw, sid, finish_copy=False)
    (repair,) = store.repair_moves()
    assert repair.outcome == "rolled_back"
    assert store.get_session(sid).tenant_id == "acme"
    assert raw.keys_under(session_dir(raw.root, "globex", sid)) == []
    assert _texts(store, sid, ids) == before
    store.move(sid, tenant_id="globex")  # and a new move goes through
    assert _texts(store, sid, ids) == before


@S3_ONLY
@POSTGRES
def test_crash_mid_delete_completes(store: SessionStore, raw: RawArtifacts) -> None:
    sid, ids = _session_with_outputs(store)
    before = _texts(store, sid, ids)
    _half_move(store, raw, sid, finish_copy=True)
    (repair,) = store.repair_moves()
    assert repair.outcome == "completed"
    assert store.get_session(sid).tenant_id == "globex"
    assert raw.keys_under(session_dir(raw.root, "acme", sid)) == []
    assert len(raw.keys_under(session_dir(raw.root, "globex", sid))) == 3  # no marker left
    assert _texts(store, sid, ids) == before


@S3_ONLY
@POSTGRES
@pytest.mark.parametrize("crashed", ["marker_written", "sources_deleted"])
def test_objects_written_at_the_source_after_a_crash_survive_the_repair(
    store: SessionStore, raw: RawArtifacts, crashed: str
) -> None:
    """Writes wait for the repair (``SessionMoving``); what landed at the old prefix
    anyway (a staged upload, a tool's own write) is kept: the marker's completion deleted
    it with the source objects, and a copy whose sources and marker were all deleted was
    taken for a partial one and the whole target deleted."""
    sid, ids = _session_with_outputs(store)
    before = _texts(store, sid, ids)
    _half_move(store, raw, sid, finish_copy=True)
    source, target = session_dir(raw.root, "acme", sid), session_dir(raw.root, "globex", sid)
    if crashed == "sources_deleted":  # killed after the last delete, the marker's
        for key in raw.storage.keys(key_prefix_of(raw.root, source)):
            raw.storage.delete(key)
        raw.storage.delete(key_of(raw.root, target / ".tmp" / MARKER))
    with pytest.raises(SessionMoving):
        store.store_oversized(sid, "late " * 3000, "bash")
    raw.storage.put(key_of(raw.root, source / "late.log"), b"landed after the crash")

    (repair,) = store.repair_moves()
    expected = "completed" if crashed == "marker_written" else "rolled_back"
    assert repair.outcome == expected
    here, there = (target, source) if expected == "completed" else (source, target)
    assert store.get_session(sid).tenant_id == ("globex" if expected == "completed" else "acme")
    assert raw.read(here / "late.log") == b"landed after the crash"
    assert raw.keys_under(there) == []
    assert _texts(store, sid, ids) == before
    store.move(sid, tenant_id="initech")  # and a new move goes through
    assert _texts(store, sid, ids) == before


@S3_ONLY
@POSTGRES
def test_a_failed_commit_puts_the_objects_back(
    store: SessionStore, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid, ids = _session_with_outputs(store)
    before = _texts(store, sid, ids)
    run = ObjectMove.run

    def move_then_fail(self: ObjectMove) -> None:
        run(self)
        raise OSError("commit never happens")

    monkeypatch.setattr(ObjectMove, "run", move_then_fail)
    with pytest.raises(OSError, match="commit never happens"):
        store.move(sid, tenant_id="globex")
    assert store.get_session(sid).tenant_id == "acme"
    assert raw.keys_under(session_dir(raw.root, "globex", sid)) == []
    assert _texts(store, sid, ids) == before
    assert store._moves.pending() == []


@S3_ONLY
@POSTGRES
def test_a_failed_commit_whose_undo_fails_is_completed_by_the_repair(
    store: SessionStore, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The intent was dropped after a failed undo: the objects stayed under the other
    tenant, with nothing left to name them."""
    sid, ids = _session_with_outputs(store)
    before = _texts(store, sid, ids)
    run, storage = ObjectMove.run, store._moves.storage

    def move_then_fail(self: ObjectMove) -> None:
        run(self)

        def refuse(source: str, target: str) -> None:
            raise OSError("S3 refuses the copy back")

        monkeypatch.setattr(storage, "copy", refuse)
        raise OSError("commit never happens")

    monkeypatch.setattr(ObjectMove, "run", move_then_fail)
    with pytest.raises(OSError, match="commit never happens"):
        store.move(sid, tenant_id="globex")
    monkeypatch.undo()
    assert store.get_session(sid).tenant_id == "acme"
    assert len(store._moves.pending()) == 1

    (repair,) = store.repair_moves()
    assert repair.outcome == "completed"
    assert store.get_session(sid).tenant_id == "globex"
    assert _texts(store, sid, ids) == before


def test_expired_outputs_named_by_path(store: SessionStore, raw: RawArtifacts) -> None:
    sid, ids = _session_with_outputs(store, 1)
    path = session_dir(raw.root, "acme", sid) / oversized_name(ids[0])
    assert raw.read(path) == ("output 0 " * 2000).encode()


def test_fork_copies_the_outputs(store: SessionStore, raw: RawArtifacts) -> None:
    sid, ids = _session_with_outputs(store)
    before = _texts(store, sid, ids)
    fork = store.fork(sid)
    assert fork.copy_status == "copied"
    assert _texts(store, fork.id, ids) == before
    assert len(raw.keys_under(session_dir(raw.root, "acme", fork.id))) == 3
    store.delete_session(sid)  # the fork's copies are its own
    assert _texts(store, fork.id, ids) == before


@S3_ONLY
def test_s3_fork_copy_is_server_side(
    store: SessionStore, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No artifact bytes are uploaded while a fork is copied: each object is a server-side
    CopyObject to a staging key of the fork's, read back once to check it against its row
    (no host's clock decides what the fork inherited), then copied to its name."""
    from typing import Any

    import obstore

    from core.artifacts import objects

    sid, ids = _session_with_outputs(store)
    calls: list[str] = []

    class Counting:
        def __getattr__(self, name: str) -> Any:
            real = getattr(obstore, name)

            def counted(*args: Any, **kwargs: Any) -> Any:
                head = name == "get" and (kwargs.get("options") or {}).get("head")
                calls.append("get(head)" if head else name)  # a HEAD moves no bytes
                return real(*args, **kwargs)

            return counted

    monkeypatch.setattr(objects, "obstore", Counting())
    fork = store.fork(sid)
    monkeypatch.undo()
    assert fork.copy_status == "copied"
    assert calls.count("copy") == 6 and calls.count("open_reader") == 3, calls
    assert "put" not in calls and not {"get", "get_range", "get_ranges"} & set(calls), calls
    assert raw.keys_under(session_dir(raw.root, "acme", fork.id) / ".tmp") == []
    assert _texts(store, fork.id, ids) == _texts(store, sid, ids)


def test_move_takes_files_and_agent_outputs_along(store: SessionStore, raw: RawArtifacts) -> None:
    sid = store.create_session(tenant_id="acme").id
    artifacts = store.artifacts(sid)
    artifacts.files.put("notes/plan.md", "# the plan")
    output = artifacts.save_agent_output("review", "# review", jsonl='{"step": 1}\n')
    tool = artifacts.save("tool text", "bash")
    store.move(sid, tenant_id="globex")
    moved = store.artifacts(sid)
    assert moved.files.get("notes/plan.md") == b"# the plan"
    assert moved.files.usage().tenant_used_bytes == len("# the plan")
    assert store.resolve(f"agent://{output}", session_id=sid).content == "# review"
    assert store.resolve(f"artifact://{tool}", session_id=sid).content == "tool text"
    assert raw.keys_under(session_dir(raw.root, "acme", sid)) == []
    moved.files.delete("notes/plan.md")
    assert raw.gone(moved.directory() / "files" / "notes" / "plan.md")


def test_rehydrated_export_is_a_ttl_artifact_on_either_backend(
    store: SessionStore, raw: RawArtifacts
) -> None:
    from core.interop.rehydrated import Request, rehydrate
    from tests.contract.test_fork import build_session

    sid = store.create_session(tenant_id="acme").id
    build_session(store, sid, turns=2)
    result = rehydrate(store, Request(sid, "acme", "pi"))
    text = store.resolve(result["ref"], session_id=sid).content
    assert len(text.encode()) == result["size"] and text.count("\n") >= 4
    spool = store.settings.artifact_spool_dir
    assert not spool.exists() or not any(p.is_file() for p in spool.rglob("*"))
    staged = raw.keys_under(session_dir(raw.root, "acme", sid) / ".tmp")
    assert staged == []  # the staging object/file went after the publish
    assert rehydrate(store, Request(sid, "acme", "pi"))["reused"] is True


@S3_ONLY
@POSTGRES
def test_expiry_sweeps_staged_uploads_killed_processes_left_on_s3(
    store: SessionStore, raw: RawArtifacts
) -> None:
    from datetime import timedelta

    from core.models import utcnow

    sid, _ids = _session_with_outputs(store, 1)
    staging = session_dir(raw.root, "acme", sid) / ".tmp"
    raw.storage.put(key_of(raw.root, staging / "dead.tmp"), b"12345")  # a killed upload
    raw.storage.put(key_of(raw.root, staging / "old.bak"), b"keep")  # for an operator
    assert store.expire_artifacts(apply=True).stale_temp_files == 0  # could still be live
    later = utcnow() + timedelta(seconds=store.settings.staging_max_age_seconds + 5)
    from core.maintenance.expiry import expire_artifacts

    report = expire_artifacts(store.engine, store.oversized, apply=True, now=later)
    assert (report.stale_temp_files, report.stale_temp_bytes) == (1, 5)
    assert raw.keys_under(staging) == [key_of(raw.root, staging / "old.bak")]


@S3_ONLY
@POSTGRES
@pytest.mark.parametrize("hours", [7, -7])
def test_expiry_judges_object_ages_by_the_stores_clock(
    store: SessionStore, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch, hours: int
) -> None:
    """A host whose clock is hours off the object store's, past the staging age (6 h):
    objects' last-modified times are the store's. Ahead, it swept a staged upload a writer
    was still making and an output published in a transaction about to commit (its row
    then named a missing object); behind, it kept a dead upload. Each is judged by its age
    on the store's clock, whatever this host's."""
    from datetime import timedelta

    from tests.support import skew_host_clock

    sid, _ids = _session_with_outputs(store, 1)
    staging = session_dir(raw.root, "acme", sid) / ".tmp"
    raw.storage.put(key_of(raw.root, staging / "live.tmp"), b"12345")  # being uploaded
    publishing = session_dir(raw.root, "acme", sid) / oversized_name("art_" + "0" * 16)
    raw.storage.put(key_of(raw.root, publishing), b"123")  # its row about to commit
    real, skew = time.time, hours * 3600.0
    monkeypatch.setattr(time, "time", lambda: real() + skew)
    skew_host_clock(monkeypatch, timedelta(hours=hours))
    report = store.expire_artifacts(apply=True)
    assert (report.stale_temp_files, report.unnamed_files) == (0, 0)
    assert raw.exists(staging / "live.tmp") and raw.exists(publishing)
    from core.maintenance.expiry import expire_artifacts

    later = real() + skew + store.settings.staging_max_age_seconds + 5  # by this host
    due = expire_artifacts(
        store.engine, store.oversized, apply=True, now=datetime.fromtimestamp(later, UTC)
    )
    assert (due.stale_temp_files, due.unnamed_files) == (1, 1)
    assert not raw.exists(staging / "live.tmp") and not raw.exists(publishing)


@S3_ONLY
@POSTGRES
def test_an_expiry_dry_run_needs_no_write(
    store: SessionStore, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dry run with a credential that may only read and list: the store's clock cannot
    be read (its probe is a write), so objects' ages are this host's, with a warning; the
    run reports what is due instead of failing its sweeps as unavailable."""
    import obstore
    from obstore.exceptions import PermissionDeniedError

    sid, _ids = _session_with_outputs(store, 1)
    staging = session_dir(raw.root, "acme", sid) / ".tmp"
    raw.storage.put(key_of(raw.root, staging / "dead.tmp"), b"12345")
    orphan = session_dir(raw.root, "acme", sid) / oversized_name("art_" + "1" * 16)
    raw.storage.put(key_of(raw.root, orphan), b"123")

    def refused(*args: object, **kwargs: object) -> None:
        raise PermissionDeniedError("403 AccessDenied")

    monkeypatch.setattr(obstore, "put", refused)
    monkeypatch.setattr(obstore, "delete", refused)
    later = time.time() + store.settings.staging_max_age_seconds + 5
    from core.maintenance.expiry import expire_artifacts

    dry = expire_artifacts(
        store.engine, store.oversized, apply=False, now=datetime.fromtimestamp(later, UTC)
    )
    assert dry.errors == [] and (dry.stale_temp_files, dry.unnamed_files) == (1, 1)


@S3_ONLY
@POSTGRES
def test_a_copy_failing_mid_move_leaves_nothing_at_the_target(
    store: SessionStore, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy that fails part way (S3 refusing the second object) removes what it copied:
    the partial copy made every later move to that tenant fail ("not empty"), for good."""
    sid, ids = _session_with_outputs(store)
    before = _texts(store, sid, ids)
    storage = store._moves.storage
    real, calls = storage.copy, {"n": 0}

    def second_fails(source: str, target: str) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("S3 said no")
        real(source, target)

    monkeypatch.setattr(storage, "copy", second_fails)
    with pytest.raises(Exception, match="S3 said no"):
        store.move(sid, tenant_id="globex")
    monkeypatch.undo()
    assert calls["n"] == 2
    assert store.get_session(sid).tenant_id == "acme"
    assert raw.keys_under(session_dir(raw.root, "globex", sid)) == []
    store.move(sid, tenant_id="globex")
    assert _texts(store, sid, ids) == before


@S3_ONLY
@POSTGRES
@pytest.mark.parametrize("undo_failed", [False, True])
def test_a_failed_moves_leftovers_are_settled_by_the_next_move(
    store: SessionStore, raw: RawArtifacts, undo_failed: bool
) -> None:
    """Objects an earlier failed move of the session left under the other tenant (no intent
    pending): a partial copy is removed; the only copy of an object (an undo that failed
    after the source objects went) is put back first. Then the move goes through, every
    output readable, nothing left behind."""
    sid, ids = _session_with_outputs(store)
    before = _texts(store, sid, ids)
    source, target = session_dir(raw.root, "acme", sid), session_dir(raw.root, "globex", sid)
    src, dst = key_prefix_of(raw.root, source), key_prefix_of(raw.root, target)
    keys = raw.storage.keys(src)
    for key in keys[:2]:
        raw.storage.copy(key, dst + key[len(src) :])
    if undo_failed:
        raw.storage.delete(keys[0])  # its only copy is at the target now
    assert store._moves.pending() == []
    store.move(sid, tenant_id="globex")
    assert store.get_session(sid).tenant_id == "globex"
    assert raw.keys_under(source) == [] and len(raw.keys_under(target)) == 3
    assert _texts(store, sid, ids) == before
    store.move(sid, tenant_id="acme")  # and back
    assert raw.keys_under(target) == [] and _texts(store, sid, ids) == before
