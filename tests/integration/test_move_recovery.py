"""Invariant 12 for moves (issue 16, item 4): a fault at every step of a move, then repair:
the artifacts are reachable and a second move succeeds. Both backends."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from core import SessionStore, Settings, nofollow
from core.artifacts import session_dir
from core.errors import SessionMoving
from core.models import MoveIntentRow
from core.sessions import lifecycle
from core.sessions.moves import Moves, _DirectoryMove
from tests.support import clean_env


class Injected(Exception):
    pass


def _with_files(store: SessionStore) -> str:
    session = store.create_session(tenant_id="acme", cwd="/a")
    artifacts = store.artifacts(session.id)
    artifacts.files.put("notes/plan.md", "# the plan")
    assert artifacts.save("tool output", "bash") == "0"
    return session.id


def _intents(store: SessionStore) -> int:
    table = MoveIntentRow.__table__  # type: ignore[attr-defined]
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def _reachable(store: SessionStore, sid: str) -> None:
    tenant = store.get_session(sid).tenant_id
    assert store.artifacts(sid).files.get("notes/plan.md") == b"# the plan"
    resolved = store.resolve("artifact://0", session_id=sid, tenant_id=tenant)
    assert resolved.content in ("tool output", b"tool output")


def _then_second_move(store: SessionStore, sid: str) -> None:
    moved = store.move(sid, tenant_id="initech", cwd="/c")
    assert (moved.tenant_id, moved.cwd) == ("initech", "/c")
    _reachable(store, sid)
    assert _intents(store) == 0


STEPS = ["after_intent", "after_rename", "before_commit"]


@pytest.mark.parametrize("step", STEPS)
def test_a_fault_at_each_step_then_repair(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    sid = _with_files(store)
    real_intent, real_run = Moves._record_intent, _DirectoryMove.run
    real_relocate = Moves._relocate

    def intent(self: Moves, *args: Any) -> Any:
        result = real_intent(self, *args)
        if step == "after_intent":
            raise Injected(step)  # outside the move's cleanup: as a crash would leave it
        return result

    def run(self: _DirectoryMove) -> None:
        real_run(self)
        if step == "after_rename":
            raise Injected(step)

    def relocate(self: Moves, *args: Any) -> None:
        real_relocate(self, *args)
        if step == "before_commit":
            raise Injected(step)

    monkeypatch.setattr(Moves, "_record_intent", intent)
    monkeypatch.setattr(_DirectoryMove, "run", run)
    monkeypatch.setattr(Moves, "_relocate", relocate)
    with pytest.raises(Injected):
        store.move(sid, tenant_id="globex", cwd="/b")
    monkeypatch.undo()

    store.repair_moves()
    assert _intents(store) == 0
    assert store.get_session(sid).tenant_id == "acme"  # nothing was renamed for good
    _reachable(store, sid)
    _then_second_move(store, sid)


_CRASHER = textwrap.dedent(
    """
    import os, signal, sys
    from core import SessionStore, Settings
    from core.sessions.moves import Moves, _DirectoryMove

    step, sid = sys.argv[1], sys.argv[2]
    real_intent, real_run = Moves._record_intent, _DirectoryMove.run

    def intent(self, *args):
        result = real_intent(self, *args)
        if step == "after_intent":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    def run(self):
        real_run(self)
        if step == "after_rename":  # renamed, the transaction not committed
            os.kill(os.getpid(), signal.SIGKILL)

    Moves._record_intent = intent
    _DirectoryMove.run = run
    with SessionStore.from_settings(Settings()) as store:
        store.move(sid, tenant_id="globex", cwd="/b")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("step", ["after_intent", "after_rename"])
def test_sigkill_mid_move_then_repair(
    store: SessionStore, settings: Settings, step: str, tmp_path: Path
) -> None:
    sid = _with_files(store)
    env = clean_env(settings.data_dir, SESSIONSTORE_DATABASE_URL=str(settings.database_url))
    script = tmp_path / "crash.py"
    script.write_text(_CRASHER)
    done = subprocess.run(
        [sys.executable, str(script), step, sid],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert _intents(store) == 1

    [repaired] = store.repair_moves()
    expected = "completed" if step == "after_rename" else "rolled_back"
    assert repaired.outcome == expected
    assert store.get_session(sid).tenant_id == ("globex" if expected == "completed" else "acme")
    if expected == "completed":
        assert store.get_session(sid).cwd == "/b"
    _reachable(store, sid)
    _then_second_move(store, sid)


def test_a_move_repairs_its_own_interrupted_move_first(store: SessionStore) -> None:
    sid = _with_files(store)
    _crash_after_rename(store, sid)
    _then_second_move(store, sid)  # no separate repair: the move finishes the old one


def _commit_and_undo_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The move's commit fails after the rename, and so does the rename back (EACCES)."""
    real_run = _DirectoryMove.run

    def refuse(*args: Any) -> None:
        raise PermissionError(errno.EACCES, "injected: the rename back is refused")

    def run_then_fail(self: _DirectoryMove) -> None:
        real_run(self)
        monkeypatch.setattr(nofollow, "rename", refuse)
        raise Injected("the commit failed")

    monkeypatch.setattr(_DirectoryMove, "run", run_then_fail)


@pytest.mark.parametrize("then", ["repair", "delete"])
def test_a_move_whose_undo_fails_keeps_its_intent_for_the_repair(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """Dropping the intent after a failed undo stranded the directory under the other
    tenant for good: no repair found it, reads failed, and a delete left it behind while
    it reported the directory removed."""
    sid = _with_files(store)
    root = store.settings.resolved_artifact_root
    source, target = session_dir(root, "acme", sid), session_dir(root, "globex", sid)
    with pytest.MonkeyPatch.context() as faults:
        _commit_and_undo_fail(faults)
        with pytest.raises(Injected):
            store.move(sid, tenant_id="globex", cwd="/b")
    assert store.get_session(sid).tenant_id == "acme" and target.is_dir()
    assert _intents(store) == 1

    if then == "repair":
        [repaired] = store.repair_moves()
        assert repaired.outcome == "completed"
        moved = store.get_session(sid)
        assert (moved.tenant_id, moved.cwd) == ("globex", "/b")
        _reachable(store, sid)
        _then_second_move(store, sid)
        return
    assert store.delete_session(sid).directory_removed is False  # its files are elsewhere
    [repaired] = store.repair_moves()
    assert repaired.outcome == "gone"
    monkeypatch.setattr(lifecycle, "REMOVAL_SETTLED", timedelta(0))
    store.expire_artifacts(apply=True)
    assert not target.exists() and not source.exists()


def _crash_after_rename(store: SessionStore, sid: str) -> None:
    """What a process killed between the rename and the commit leaves."""
    with pytest.MonkeyPatch.context() as crash:
        real_run = _DirectoryMove.run

        def run_then_crash(self: _DirectoryMove) -> None:
            real_run(self)
            raise Injected("crash")

        crash.setattr(_DirectoryMove, "run", run_then_crash)
        crash.setattr(_DirectoryMove, "undo", lambda self: True)  # a crash undoes nothing
        crash.setattr(Moves, "_drop_intent", lambda self, sid: None)
        with pytest.raises(Injected):
            store.move(sid, tenant_id="globex", cwd="/b")
    assert _intents(store) == 1


def test_writes_during_an_interrupted_move_are_refused_until_its_repair(
    store: SessionStore,
) -> None:
    """Written where the row still said (the old tenant), they re-created the old directory
    beside the moved one; the repair then rolled back and left every earlier file behind."""
    sid = _with_files(store)
    artifacts = store.artifacts(sid)
    _crash_after_rename(store, sid)
    with pytest.raises(SessionMoving):
        artifacts.save("written after the crash", "bash")
    with pytest.raises(SessionMoving):
        store.store_oversized(sid, "y" * 13_000, "grep")
    with pytest.raises(SessionMoving):
        artifacts.files.put("late.md", "late")
    with pytest.raises(SessionMoving):
        artifacts.allocate_path("bash")

    [repaired] = store.repair_moves()
    assert repaired.outcome == "completed"
    assert store.get_session(sid).tenant_id == "globex"
    root = store.settings.resolved_artifact_root
    assert not session_dir(root, "acme", sid).exists()  # what staging re-created is merged
    _reachable(store, sid)
    late = artifacts.save("written after the repair", "bash")
    assert store.resolve(f"artifact://{late}", session_id=sid).content == (
        "written after the repair"
    )
    _then_second_move(store, sid)


def test_a_repair_merges_files_written_to_the_old_directory_after_the_crash(
    store: SessionStore,
) -> None:
    """A tool given its path before the crash writes there after it, re-creating the old
    directory: the repair completes the move with both directories' files, none left."""
    sid = _with_files(store)
    slot = store.artifacts(sid).allocate_path("bash")
    _crash_after_rename(store, sid)
    slot.path.parent.mkdir(parents=True)  # as a tool's own ``mkdir -p`` would
    slot.path.write_text("written to the path it was given")
    root = store.settings.resolved_artifact_root
    source, target = session_dir(root, "acme", sid), session_dir(root, "globex", sid)
    assert source.is_dir() and target.is_dir()

    [repaired] = store.repair_moves()
    assert repaired.outcome == "completed"
    assert not source.exists()
    artifacts = store.artifacts(sid)
    assert artifacts.finalize_tool_output(slot.id) == len("written to the path it was given")
    resolved = store.resolve(f"artifact://{slot.id}", session_id=sid)
    assert resolved.content == "written to the path it was given"
    _reachable(store, sid)
    _then_second_move(store, sid)
