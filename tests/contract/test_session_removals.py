"""A deleted session's directory is removed even when its delete could not remove it: the
delete records it in its transaction (``session_removals``), drops the record once the
directory is gone, and the expiry run removes what a crash, a failing disk or S3 away left.
On SQLite and PostgreSQL, with file and S3 artifact storage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, select

from core import SessionStore
from core.artifacts import session_dir
from core.artifacts.inherited import held_dir
from core.artifacts.objects import ObjectArtifactStorage
from core.errors import StorageUnavailable
from core.models import MoveIntentRow, SessionRemovalRow, table_of, utcnow
from core.sessions import lifecycle
from core.sessions.lifecycle import SessionLifecycle
from tests.contract.artifact_backends import (
    FILE_ONLY,
    RawArtifacts,
    artifact_backend,
    raw,
    settings,
)
from tests.contract.test_fork import defer_copies
from tests.contract.test_move_delete import _with_files

__all__ = ["FILE_ONLY", "RawArtifacts", "artifact_backend", "raw", "settings"]

_removals = table_of(SessionRemovalRow)


def _records(store: SessionStore) -> list[tuple[str, str]]:
    with store.engine.connect() as conn:
        rows = conn.execute(select(_removals.c.session_id, _removals.c.kind)).all()
    return sorted((r[0], r[1]) for r in rows)


def _fail_removals(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable(*args: Any, **kwargs: Any) -> None:
        raise StorageUnavailable("artifacts", "artifacts is unavailable: injected")

    monkeypatch.setattr(lifecycle.nofollow, "rmtree", unavailable)
    monkeypatch.setattr(ObjectArtifactStorage, "delete_prefix", unavailable)


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Records count as left behind at once (by default only after five minutes)."""
    monkeypatch.setattr(lifecycle, "REMOVAL_SETTLED", lifecycle.timedelta(0))


def _sweep(store: SessionStore, *, apply: bool) -> dict[str, Any]:
    report: dict[str, Any] = store.expire_artifacts(apply=apply).to_dict()
    return report


def test_a_delete_that_removes_its_directory_leaves_no_record(
    store: SessionStore, raw: RawArtifacts
) -> None:
    sid = _with_files(store)
    directory = session_dir(store.settings.resolved_artifact_root, "acme", sid)
    assert not raw.gone(directory)
    assert store.delete_session(sid).directory_removed
    assert raw.gone(directory) and _records(store) == []


def test_a_directory_a_failing_storage_kept_is_removed_by_the_next_expiry_run(
    store: SessionStore, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch, settled: None
) -> None:
    sid = _with_files(store)
    directory = session_dir(store.settings.resolved_artifact_root, "acme", sid)
    with monkeypatch.context() as failing:
        _fail_removals(failing)
        assert store.delete_session(sid).directory_removed is False
        assert not raw.gone(directory) and _records(store) == [(sid, "session")]
        failed = _sweep(store, apply=True)  # still failing: kept, said, retried next run
        assert failed["session_directories_removed"] == 0 and failed["errors"]
    assert not raw.gone(directory) and _records(store) == [(sid, "session")]

    dry = _sweep(store, apply=False)
    assert dry["session_directories_to_remove"] == 1 and not raw.gone(directory)
    done = _sweep(store, apply=True)
    assert done["session_directories_removed"] == 1 and done["errors"] == []
    assert raw.gone(directory) and _records(store) == []
    assert _sweep(store, apply=True)["session_directories_removed"] == 0


def test_a_delete_killed_after_its_commit_leaves_a_record_not_an_orphan(
    store: SessionStore, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch, settled: None
) -> None:
    sid = _with_files(store)
    directory = session_dir(store.settings.resolved_artifact_root, "acme", sid)

    def killed(self: SessionLifecycle, report: Any) -> Any:
        raise SystemExit("killed between the commit and the directory's removal")

    with monkeypatch.context() as crash:
        crash.setattr(SessionLifecycle, "_remove_directory", killed)
        with pytest.raises(SystemExit):
            store.delete_session(sid)
    assert not raw.gone(directory) and _records(store) == [(sid, "session")]
    assert _sweep(store, apply=True)["session_directories_removed"] == 1
    assert raw.gone(directory) and _records(store) == []


def test_a_record_is_left_to_its_own_delete_for_a_while(
    store: SessionStore, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete removes its directory right after its commit: the expiry run never races
    it (the record must have been there REMOVAL_SETTLED)."""
    sid = _with_files(store)
    with monkeypatch.context() as failing:
        _fail_removals(failing)
        store.delete_session(sid)
    report = _sweep(store, apply=True)
    assert report["session_directories_removed"] == 0 and _records(store) == [(sid, "session")]


def test_an_interrupted_move_is_repaired_first(
    store: SessionStore, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch, settled: None
) -> None:
    sid = _with_files(store)
    directory = session_dir(store.settings.resolved_artifact_root, "acme", sid)
    with monkeypatch.context() as failing:
        _fail_removals(failing)
        store.delete_session(sid)
    with store.engine.begin() as conn:  # as a move a crash interrupted leaves it
        conn.execute(
            insert(table_of(MoveIntentRow)).values(
                session_id=sid, from_tenant="acme", to_tenant="beta", started_at=utcnow()
            )
        )
    report = _sweep(store, apply=True)
    assert report["session_directories_removed"] == 0
    assert any("sessions repair" in e for e in report["errors"])
    assert not raw.gone(directory) and _records(store) == [(sid, "session")]


@FILE_ONLY  # a parent holds files for a pending fork on the file store only
def test_what_a_parent_held_for_a_deleted_fork_is_found_where_the_parent_moved(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, settled: None
) -> None:
    root = store.settings.resolved_artifact_root
    parent = _with_files(store)
    defer_copies(store)
    fork = store.fork(parent).id
    held = held_dir(session_dir(root, "acme", parent), fork)
    held.mkdir(parents=True)
    (held / "kept.txt").write_text("held for the fork")
    real_rmtree = lifecycle.nofollow.rmtree

    def held_fails(root: Path, path: Path) -> None:
        if path == held:
            raise OSError(5, "Input/output error", str(path))
        real_rmtree(root, path)

    with monkeypatch.context() as failing:
        failing.setattr(lifecycle.nofollow, "rmtree", held_fails)
        assert store.delete_session(fork).directory_removed
    assert _records(store) == [(fork, "held")] and (held / "kept.txt").exists()

    store.move(parent, tenant_id="beta")  # the held files move with the parent's directory
    moved = held_dir(session_dir(root, "beta", parent), fork)
    assert (moved / "kept.txt").exists()
    assert _sweep(store, apply=True)["session_directories_removed"] == 1
    assert not moved.exists() and _records(store) == []
    assert store.artifacts(parent).files.get("notes/plan.md") == b"# the plan"


def test_the_record_is_in_the_deletes_transaction(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete that fails before its commit records nothing (and deletes nothing)."""
    sid = _with_files(store)

    def fails(*args: Any) -> None:
        raise RuntimeError("the database went away mid-delete")

    monkeypatch.setattr(lifecycle, "delete_snapshots", fails)
    with pytest.raises(RuntimeError):
        store.delete_session(sid)
    assert store.get_session(sid).head_seq > 0 and _records(store) == []
