"""A deleted session's directory is removed even when its delete could not remove it: the
delete records it in its transaction (``session_removals``), drops the record once the
directory is gone, and the expiry run removes what a crash, a failing disk or S3 away left.
On SQLite and PostgreSQL, with file and S3 artifact storage."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, select

from core import SessionNotFound, SessionStore, nofollow
from core.artifacts import session_dir
from core.artifacts.inherited import held_dir
from core.artifacts.objects import ObjectArtifactStorage
from core.artifacts.storage import FileArtifactStorage
from core.errors import StorageUnavailable, SymlinkRefused
from core.models import MoveIntentRow, SessionRemovalRow, table_of, utcnow
from core.sessions import lifecycle
from core.sessions.lifecycle import SessionLifecycle
from tests.cli_process import run_cli
from tests.contract.artifact_backends import (
    FILE_ONLY,
    RawArtifacts,
    artifact_backend,
    raw,
    settings,
)
from tests.contract.test_fork import defer_copies
from tests.contract.test_move_delete import _with_files, fail_removals
from tests.support import outcome_within, store_env

__all__ = ["FILE_ONLY", "RawArtifacts", "artifact_backend", "raw", "settings"]

_removals = table_of(SessionRemovalRow)
AN_HOUR = timedelta(hours=1)  # older than the reconciler's timeout: crashed, not live


def _records(store: SessionStore) -> list[tuple[str, str]]:
    with store.engine.connect() as conn:
        rows = conn.execute(select(_removals.c.session_id, _removals.c.kind)).all()
    return sorted((r[0], r[1]) for r in rows)


def _delete_while_storage_fails(store: SessionStore, *session_ids: str) -> None:
    """Delete each session while its directory cannot be removed (S3 away, a failing disk)."""
    with pytest.MonkeyPatch.context() as failing:
        fail_removals(failing)
        for sid in session_ids:
            assert store.delete_session(sid).directory_removed is False


@contextmanager
def _parent_moves_when(held: Path, store: SessionStore, parent: str) -> Iterator[None]:
    """The parent's move renames its directory just before ``held`` is removed."""
    real = SessionLifecycle._remove_tree

    def parent_moves_first(self: SessionLifecycle, directory: Path, what: str, **kw: bool) -> bool:
        if directory == held:
            store.move(parent, tenant_id="beta")
        return real(self, directory, what, **kw)

    with pytest.MonkeyPatch.context() as racing:
        racing.setattr(SessionLifecycle, "_remove_tree", parent_moves_first)
        yield


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Records count as left behind at once (by default only after five minutes)."""
    monkeypatch.setattr(lifecycle, "REMOVAL_SETTLED", timedelta(0))


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
        fail_removals(failing)
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


def test_a_record_is_left_to_its_own_delete_for_a_while(store: SessionStore) -> None:
    """A delete removes its directory right after its commit: the expiry run never races
    it (the record must have been there REMOVAL_SETTLED)."""
    sid = _with_files(store)
    _delete_while_storage_fails(store, sid)
    report = _sweep(store, apply=True)
    assert report["session_directories_removed"] == 0 and _records(store) == [(sid, "session")]


def test_a_directory_whose_session_is_in_a_move_waits_for_it(
    store: SessionStore, raw: RawArtifacts, settled: None
) -> None:
    sid = _with_files(store)
    directory = session_dir(store.settings.resolved_artifact_root, "acme", sid)
    _delete_while_storage_fails(store, sid)
    _move_intent(store, sid, age=timedelta(0))  # as a move a crash interrupted leaves it
    report = _sweep(store, apply=True)
    assert report["session_directories_removed"] == 0 and report["errors"] == []
    assert report["session_directories_deferred"] == 1  # waiting is no failure: exit 0
    assert not raw.gone(directory) and _records(store) == [(sid, "session")]


def _parent_holding_for_a_pending_fork(store: SessionStore) -> tuple[str, str, Path]:
    """(parent, fork, what the parent holds for the fork): as a link planted at the
    fork's directory leaves it (the parent's rewrite keeps the inherited file there)."""
    root = store.settings.resolved_artifact_root
    parent = _with_files(store)
    defer_copies(store)
    fork = store.fork(parent).id
    held = held_dir(session_dir(root, "acme", parent), fork)
    held.mkdir(parents=True)
    (held / "kept.txt").write_text("held for the fork")
    return parent, fork, held


@FILE_ONLY  # a parent holds files for a pending fork on the file store only
def test_what_a_parent_held_for_a_deleted_fork_is_found_where_the_parent_moved(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, settled: None
) -> None:
    root = store.settings.resolved_artifact_root
    parent, fork, held = _parent_holding_for_a_pending_fork(store)
    real_rmtree = nofollow.rmtree

    def held_fails(root: Path, path: Path) -> int:
        if path == held:
            raise OSError(5, "Input/output error", str(path))
        return real_rmtree(root, path)

    with monkeypatch.context() as failing:
        failing.setattr(nofollow, "rmtree", held_fails)
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


# --- after review: each of these failed on the first version -------------------------------


def test_a_delete_finishes_an_interrupted_move_first(
    store: SessionStore, raw: RawArtifacts
) -> None:
    """A move killed after its rename, before its commit: the row says acme, the files are
    under beta. The delete repairs the move first, so it removes where the files are (it
    removed acme's absent directory and called it done)."""
    root = store.settings.resolved_artifact_root
    sid = _with_files(store)
    source, target = session_dir(root, "acme", sid), session_dir(root, "beta", sid)
    _interrupted_move(store, raw, sid, source, target)
    assert store.delete_session(sid).directory_removed
    assert raw.gone(source) and raw.gone(target) and _records(store) == []


def _move_intent(store: SessionStore, sid: str, *, age: timedelta) -> None:
    """The intent row of a move of ``sid`` from acme to beta, started ``age`` ago."""
    with store.engine.begin() as conn:
        conn.execute(
            insert(table_of(MoveIntentRow)).values(
                session_id=sid, from_tenant="acme", to_tenant="beta", started_at=utcnow() - age
            )
        )


def _interrupted_move(
    store: SessionStore,
    raw: RawArtifacts,
    sid: str,
    source: Path,
    target: Path,
    *,
    age: timedelta = AN_HOUR,
) -> None:
    """A move of ``sid`` from acme to beta killed after its rename, ``age`` ago."""
    _move_intent(store, sid, age=age)
    root = store.settings.resolved_artifact_root
    if raw.on_files:  # the rename done
        target.parent.mkdir(parents=True, exist_ok=True)
        source.rename(target)
    else:  # on S3: every object copied over, the originals removed
        for key in raw.keys_under(source):
            moved = (target / (root / key).relative_to(source)).relative_to(root).as_posix()
            raw.storage.copy(key, moved)
            raw.storage.delete(key)
    assert raw.gone(source) and not raw.gone(target)


def test_a_move_repaired_after_its_session_was_deleted_names_both_directories(
    store: SessionStore, raw: RawArtifacts, settled: None
) -> None:
    """The session went while a move of it was half done (too young for the delete to
    repair): its files may be under either tenant. The repair's "gone" records both, and
    the expiry run removes both."""
    root = store.settings.resolved_artifact_root
    sid = _with_files(store)
    source, target = session_dir(root, "acme", sid), session_dir(root, "beta", sid)
    # a young intent may be a live move: the delete leaves it to the reconciler
    _interrupted_move(store, raw, sid, source, target, age=timedelta(0))
    # acme's is absent, but the files may be at beta: nothing is claimed removed, and the
    # record stays for the expiry run after the repair
    assert store.delete_session(sid).directory_removed is False
    assert not raw.gone(target) and _records(store) == [(sid, "session")]
    [repair] = store.repair_moves()
    assert repair.outcome == "gone"
    assert _records(store) == [(sid, "moved"), (sid, "session")]
    assert _sweep(store, apply=True)["session_directories_removed"] == 2
    assert raw.gone(source) and raw.gone(target) and _records(store) == []


@pytest.mark.parametrize("backend", ["postgres"])
def test_the_wait_is_by_the_database_clock(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deleting host whose clock is six minutes behind: on PostgreSQL the record is
    stamped by the database's clock, so it is not settled at once (with the host's time it
    was, and the expiry run raced the delete). PostgreSQL only: an embedded SQLite
    database's clock is its one host's, the same on both sides."""
    sid = _with_files(store)
    behind = utcnow() - timedelta(minutes=6)
    # the host's clock wherever the stamp could read it: core.models, and lifecycle's own
    # name should it ever import utcnow (it does not: a stamp by the host is the defect)
    for module in ("core.models", "core.sessions.lifecycle"):
        monkeypatch.setattr(f"{module}.utcnow", lambda: behind, raising=False)
    _delete_while_storage_fails(store, sid)
    assert _sweep(store, apply=True)["session_directories_removed"] == 0
    assert _records(store) == [(sid, "session")]


def test_directories_that_cannot_be_removed_never_hold_up_the_others(
    store: SessionStore, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch, settled: None
) -> None:
    root = store.settings.resolved_artifact_root
    stuck = [_with_files(store) for _ in range(3)]
    free = _with_files(store)  # deleted last: its record comes after the stuck ones
    _delete_while_storage_fails(store, *stuck, free)
    unremovable = {session_dir(root, "acme", sid) for sid in stuck}
    real = SessionLifecycle._remove_tree

    def fails_for_stuck(self: SessionLifecycle, directory: Path, what: str, **kw: bool) -> bool:
        return directory not in unremovable and real(self, directory, what, **kw)

    monkeypatch.setattr(SessionLifecycle, "_remove_tree", fails_for_stuck)
    report = store._lifecycle.finish_removals(apply=True, page=2)
    assert (report.pending, report.removed, len(report.errors)) == (4, 1, 3)
    assert raw.gone(session_dir(root, "acme", free))
    assert _records(store) == sorted((sid, "session") for sid in stuck)


@FILE_ONLY
def test_a_tree_is_removed_whole_when_entries_vanish_during_the_walk(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another remover takes an entry first: the walk skips it and goes on (it stopped
    there, and a delete said the directory was removed with files still in it)."""
    sid = _with_files(store)
    directory = session_dir(store.settings.resolved_artifact_root, "acme", sid)
    real_unlink = os.unlink
    taken: list[str] = []

    def another_remover_first(name: Any, *, dir_fd: int | None = None) -> None:
        if not taken:
            taken.append(name)
            real_unlink(name, dir_fd=dir_fd)
        real_unlink(name, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", another_remover_first)
    assert store.delete_session(sid).directory_removed
    assert taken and not directory.exists() and _records(store) == []


@FILE_ONLY
def test_held_files_moved_with_their_parent_during_the_delete_stay_named(
    store: SessionStore, settled: None
) -> None:
    root = store.settings.resolved_artifact_root
    parent, fork, held = _parent_holding_for_a_pending_fork(store)
    with _parent_moves_when(held, store, parent):
        store.delete_session(fork)
    moved = held_dir(session_dir(root, "beta", parent), fork)
    assert (moved / "kept.txt").exists() and _records(store) == [(fork, "held")]
    assert _sweep(store, apply=True)["session_directories_removed"] == 1
    assert not moved.exists() and _records(store) == []


@FILE_ONLY
def test_the_cli_says_who_removes_a_directory_its_delete_could_not(
    store: SessionStore, tmp_path: Path
) -> None:
    sid = _with_files(store)
    directory = session_dir(store.settings.resolved_artifact_root, "acme", sid)
    elsewhere = tmp_path / "elsewhere"
    directory.rename(elsewhere)
    directory.symlink_to(elsewhere)  # a planted link: removed never, followed never
    done = run_cli("sessions", "delete", sid, "--yes", env=store_env(store.settings))
    assert done.returncode == 0, done.stderr
    assert "the next expiry run removes it" in done.stdout
    assert _records(store) == [(sid, "session")] and any(elsewhere.rglob("plan.md"))


def test_a_delete_in_another_tenant_touches_nothing(store: SessionStore, raw: RawArtifacts) -> None:
    """Visibility first: a delete scoped to a tenant the session is not in neither deletes
    nor repairs its interrupted move (it completed the move, then said not found)."""
    root = store.settings.resolved_artifact_root
    sid = _with_files(store)
    source, target = session_dir(root, "acme", sid), session_dir(root, "beta", sid)
    _interrupted_move(store, raw, sid, source, target)
    with pytest.raises(SessionNotFound):
        store.delete_session(sid, tenant_id="globex")
    assert store.get_session(sid).tenant_id == "acme"
    assert [i.session_id for i in store._moves.pending()] == [sid]


@FILE_ONLY
def test_held_files_whose_parent_moves_during_the_run_are_deferred_not_failed(
    store: SessionStore, settled: None
) -> None:
    root = store.settings.resolved_artifact_root
    parent, fork, held = _parent_holding_for_a_pending_fork(store)
    _delete_while_storage_fails(store, fork)
    with _parent_moves_when(held, store, parent):
        report = _sweep(store, apply=True)
    assert report["errors"] == [] and report["session_directories_deferred"] == 1
    assert _records(store) == [(fork, "held")]
    assert _sweep(store, apply=True)["session_directories_removed"] == 1
    assert not held_dir(session_dir(root, "beta", parent), fork).exists()


@FILE_ONLY
def test_a_fifo_at_a_session_directory_is_refused_never_waited_on(
    store: SessionStore, settled: None
) -> None:
    sid = _with_files(store)
    directory = session_dir(store.settings.resolved_artifact_root, "acme", sid)
    shutil.rmtree(directory)
    os.mkfifo(directory)
    kind, value = outcome_within(
        lambda: (store.delete_session(sid), _sweep(store, apply=True)), directory, deadline_s=30
    )
    assert kind == "returned", value
    deleted, swept = value
    assert deleted.directory_removed is False and swept["errors"]
    assert _records(store) == [(sid, "session")]


@FILE_ONLY
def test_a_directory_swapped_for_a_link_after_the_check_is_refused(
    store: SessionStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = _with_files(store)
    directory = session_dir(store.settings.resolved_artifact_root, "acme", sid)
    outside = tmp_path / "outside"
    real_open = os.open

    def swapped(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if path == directory.name and dir_fd is not None and not outside.exists():
            directory.rename(outside)  # the checked directory goes, a link comes
            directory.symlink_to(outside)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", swapped)
    with pytest.raises(SymlinkRefused):
        nofollow.rmtree(store.settings.resolved_artifact_root, directory)
    assert any(outside.rglob("plan.md"))  # nothing removed through the link


def test_a_sweep_stops_at_the_first_removal_the_storage_cannot_serve(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, settled: None
) -> None:
    """S3 down: one directory's removal waits out the store's retries, then the run stops
    and reports it, rather than each further directory waiting them out too (up to a
    thousand records: hours of an expiry run)."""
    sids = [_with_files(store) for _ in range(4)]
    _delete_while_storage_fails(store, *sids)
    tried: list[str] = []

    def unavailable(self: Any, prefix: str) -> None:
        tried.append(prefix)
        raise StorageUnavailable("artifacts", "artifacts is unavailable: injected")

    with monkeypatch.context() as failing:
        failing.setattr(FileArtifactStorage, "delete_prefix", unavailable)
        failing.setattr(ObjectArtifactStorage, "delete_prefix", unavailable)
        report = store._lifecycle.finish_removals(apply=True)
    assert len(tried) == 1 and report.removed == 0
    assert any("run stopped" in e for e in report.errors), report.errors
    assert len(_records(store)) == 4  # all kept for the next run
    assert store._lifecycle.finish_removals(apply=True).removed == 4
