"""Move (all or nothing, with the artifact directory) and delete (everything but the blobs,
forks keep working), on SQLite and PostgreSQL; and the CLI commands in a subprocess."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import func, select

from core import SessionNotFound, SessionStore, Settings
from core.artifacts import fsio, session_dir
from core.artifacts.objects import ObjectArtifactStorage
from core.artifacts.paths import encode_component
from core.artifacts.storage import FileArtifactStorage
from core.errors import ExternalIdTaken, MoveFailed, QuotaExceeded, StorageUnavailable
from core.models import (
    ArtifactRow,
    BlobRefRow,
    CounterRow,
    DeadLetterRow,
    EventRow,
    SessionRow,
    SnapshotRow,
    WriteRow,
)
from core.sessions.moves import _DirectoryMove
from tasks.cli.samples import EntryBuilder
from tests.cli_process import run_cli
from tests.contract.artifact_backends import (
    FILE_ONLY,
    RawArtifacts,
    artifact_backend,
    raw,
    settings,
)
from tests.contract.test_fork import CopyFault, build_session, comparable, defer_copies
from tests.support import store_env

__all__ = ["FILE_ONLY", "RawArtifacts", "artifact_backend", "raw", "settings"]

SESSION_TABLES = [
    EventRow,
    BlobRefRow,
    WriteRow,
    ArtifactRow,
    CounterRow,
    SnapshotRow,
    DeadLetterRow,
]


def _rows(store: SessionStore, model: Any, session_id: str) -> int:
    table = model.__table__
    column = table.c.id if model is SessionRow else table.c.session_id
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).where(column == session_id)).scalar_one())


def _directory(store: SessionStore, session_id: str) -> Path:
    session = store.get_session(session_id)
    return session_dir(store.settings.resolved_artifact_root, session.tenant_id, session_id)


def fail_removals(monkeypatch: pytest.MonkeyPatch) -> None:
    """A session directory's removal fails, on either storage (S3 away, a failing disk)."""

    def unavailable(*args: Any, **kwargs: Any) -> None:
        raise StorageUnavailable("artifacts", "artifacts is unavailable: injected")

    monkeypatch.setattr(FileArtifactStorage, "delete_prefix", unavailable)
    monkeypatch.setattr(ObjectArtifactStorage, "delete_prefix", unavailable)


def _with_files(store: SessionStore) -> str:
    session = store.create_session(tenant_id="acme", cwd="/work/a")
    build_session(store, session.id, turns=2)
    artifacts = store.artifacts(session.id)
    artifacts.files.put("notes/plan.md", "# the plan")
    artifacts.save_agent_output("review", "# review", jsonl='{"step": 1}\n')
    return session.id


# --- move -------------------------------------------------------------------------------------


@FILE_ONLY  # filesystem mechanics; S3: test_artifacts_s3_moves.py
def test_move_to_another_tenant_takes_the_directory_along(store: SessionStore) -> None:
    sid = _with_files(store)
    old_dir = _directory(store, sid)
    before = store.resolve("artifact://1", session_id=sid).content

    moved = store.move(sid, tenant_id="globex", cwd="/work/b")

    assert (moved.tenant_id, moved.cwd) == ("globex", "/work/b")
    new_dir = _directory(store, sid)
    assert not old_dir.exists() and (new_dir / "files" / "notes" / "plan.md").is_file()
    assert store.resolve("artifact://1", session_id=sid, tenant_id="globex").content == before
    assert store.artifacts(sid).files.get("notes/plan.md") == b"# the plan"
    assert store.artifacts(sid).files.usage().tenant_used_bytes == len("# the plan")
    with pytest.raises(SessionNotFound):
        store.get_session(sid, tenant_id="acme")
    assert store.read_all(tenant_id="acme") == []
    assert len(store.read_all(tenant_id="globex")) == moved.head_seq


def test_a_move_into_a_tenant_holding_its_external_id_is_refused_typed(
    store: SessionStore, settings: Settings
) -> None:
    """(tenant, external id) is unique: the move failed with SQLAlchemy's IntegrityError, a
    traceback from the CLI (found by a CLI review). Now ExternalIdTaken, as creating such a
    session says it, and nothing moved; the CLI prints one line."""
    sid = store.create_session(tenant_id="acme", external_id="agent-1").id
    store.append(sid, [{"type": "custom"}])
    store.artifacts(sid).save("out", "bash")
    other = store.create_session(tenant_id="globex", external_id="agent-1").id
    with pytest.raises(ExternalIdTaken, match=r"tenant globex already has .* agent-1"):
        store.move(sid, tenant_id="globex")
    assert store.get_session(sid).tenant_id == "acme"
    assert store.resolve("artifact://0", session_id=sid).content == "out"
    assert store.get_session(other).head_seq == 0
    assert store.repair_moves() == []  # no intent left behind
    done = run_cli(
        "sessions", "move", sid, "--tenant", "globex", env=store_env(settings), timeout=60
    )
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "already has a session with external id agent-1" in done.stderr


@FILE_ONLY  # filesystem mechanics; S3: test_artifacts_s3_moves.py
def test_moving_only_the_cwd_keeps_the_directory(store: SessionStore) -> None:
    sid = _with_files(store)
    directory = _directory(store, sid)
    moved = store.move(sid, cwd="/elsewhere")
    assert (moved.tenant_id, moved.cwd) == ("acme", "/elsewhere")
    assert _directory(store, sid) == directory and directory.is_dir()


@FILE_ONLY  # filesystem mechanics; S3: test_artifacts_s3_moves.py
def test_a_failed_directory_move_rolls_the_metadata_back(store: SessionStore) -> None:
    sid = _with_files(store)
    before = store.get_session(sid)
    old_dir = _directory(store, sid)
    # A real filesystem failure: a file sits where the new tenant's directory must go.
    root = store.settings.resolved_artifact_root
    (root / encode_component("globex")).write_text("in the way")

    with pytest.raises(OSError) as raised:
        store.move(sid, tenant_id="globex", cwd="/work/b")

    assert not isinstance(raised.value, MoveFailed)  # the original error surfaces
    assert store.get_session(sid) == before
    assert old_dir.is_dir()
    assert store.artifacts(sid).files.get("notes/plan.md") == b"# the plan"


@FILE_ONLY  # filesystem mechanics; S3: test_artifacts_s3_moves.py
def test_a_failure_after_the_rename_puts_the_directory_back(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = _with_files(store)
    before = store.get_session(sid)
    old_dir = _directory(store, sid)
    rename = _DirectoryMove.run

    def rename_then_fail(self: _DirectoryMove) -> None:
        rename(self)
        assert self.target.is_dir() and not self.source.exists()
        raise RuntimeError("the commit failed")

    monkeypatch.setattr(_DirectoryMove, "run", rename_then_fail)
    with pytest.raises(RuntimeError, match="the commit failed"):
        store.move(sid, tenant_id="globex")

    assert store.get_session(sid) == before
    assert old_dir.is_dir()
    assert not session_dir(store.settings.resolved_artifact_root, "globex", sid).exists()


@FILE_ONLY  # filesystem mechanics; S3: test_artifacts_s3_moves.py
def test_a_move_never_replaces_an_existing_directory(store: SessionStore) -> None:
    sid = _with_files(store)
    target = session_dir(store.settings.resolved_artifact_root, "globex", sid)
    target.mkdir(parents=True)
    with pytest.raises(MoveFailed, match="already exists"):
        store.move(sid, tenant_id="globex")
    assert store.get_session(sid).tenant_id == "acme"


def test_a_move_over_the_target_tenants_quota_is_refused(settings: Settings) -> None:
    with SessionStore.from_settings(settings.with_overrides(quota_tenant_bytes=1000)) as store:
        sid = store.create_session(tenant_id="acme").id
        store.artifacts(sid).files.put("a.txt", "x" * 600)
        other = store.create_session(tenant_id="globex").id
        store.artifacts(other).files.put("b.txt", "y" * 600)
        with pytest.raises(QuotaExceeded, match="tenant quota exceeded"):
            store.move(sid, tenant_id="globex")
        assert store.get_session(sid).tenant_id == "acme"
        assert store.artifacts(sid).files.get("a.txt") == b"x" * 600


def test_moving_a_parent_first_finishes_its_forks_copies(store: SessionStore) -> None:
    sid = _with_files(store)
    defer_copies(store)
    fork = store.fork(sid)
    assert fork.copy_status == "pending"
    store.move(sid, tenant_id="globex")
    assert store.get_session(fork.id).copy_status == "copied"
    assert store.artifacts(fork.id).files.get("notes/plan.md") == b"# the plan"
    assert store.resolve("agent://0-review", session_id=fork.id).content == "# review"


@pytest.mark.parametrize("action", ["delete", "move"])
def test_a_parent_whose_fork_copy_meets_a_storage_outage_is_neither_deleted_nor_moved(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    """The fork's copy cannot finish while the disk is full (S3 away): the parent's delete
    or move is refused as ``StorageUnavailable`` (the caller retries), the copy stays
    pending and the fork keeps what it inherited. The delete went ahead and removed the
    parent's directory: the fork's artifact://0 was not found."""
    sid = _with_files(store)
    defer_copies(store)
    fork = store.fork(sid)
    fault = CopyFault(monkeypatch)

    def act() -> None:
        if action == "delete":
            store.delete_session(sid)
        else:
            store.move(sid, tenant_id="globex")

    with pytest.raises(StorageUnavailable, match=f"cannot {action}"):
        act()
    assert store.get_session(sid).tenant_id == "acme"
    assert store.get_session(fork.id).copy_status == "pending"
    inherited = store.resolve("artifact://0", session_id=fork.id).content
    assert inherited.startswith("full output of turn 0")

    fault.cleared()
    act()
    assert store.get_session(fork.id).copy_status == "copied"
    assert store.resolve("artifact://0", session_id=fork.id).content == inherited
    assert store.artifacts(fork.id).files.get("notes/plan.md") == b"# the plan"


# --- delete -----------------------------------------------------------------------------------


def test_delete_removes_the_session_and_everything_that_names_it(store: SessionStore) -> None:
    sid = _with_files(store)
    store.append(sid, [EntryBuilder(counter=99).user("keyed")], idempotency_key="k1")
    store.dead_letters.record(
        idempotency_key="k2",
        session_id=sid,
        events=[{"bad": 1}],
        expected_seq=None,
        error=ValueError("x"),
    )
    store.state(sid)
    directory = _directory(store, sid)
    blobs = store.blob_stats().blob_count
    keep = store.create_session(tenant_id="acme").id

    report = store.delete_session(sid)

    assert (report.events, report.artifacts, report.directory_removed) == (10, 4, True)
    for model in [SessionRow, *SESSION_TABLES]:
        assert _rows(store, model, sid) == 0, model.__name__
    assert not directory.exists()
    with pytest.raises(SessionNotFound):
        store.get_session(sid)
    assert store.blob_stats().blob_count == blobs  # blobs are left for GC
    assert store.gc_blobs(apply=True, grace=0).deleted == blobs
    assert [s.id for s in store.list_sessions().items] == [keep]


def test_a_delete_whose_artifacts_cannot_be_removed_reports_it(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The storage fails (S3 away, a failing disk) after the session's rows are gone: the
    delete is done and says its directory was not removed, as for a local OSError (it
    raised StorageUnavailable, so the caller saw a failed delete of a deleted session)."""
    sid = _with_files(store)
    fail_removals(monkeypatch)
    report = store.delete_session(sid)
    assert report.directory_removed is False
    with pytest.raises(SessionNotFound):
        store.get_session(sid)


def test_delete_is_scoped_by_tenant(store: SessionStore) -> None:
    sid = _with_files(store)
    with pytest.raises(SessionNotFound):
        store.delete_session(sid, tenant_id="globex")
    assert store.get_session(sid).head_seq == 9


def test_deleting_a_parent_leaves_its_fork_readable_and_rehydratable(store: SessionStore) -> None:
    sid = _with_files(store)
    defer_copies(store)
    fork = store.fork(sid)
    assert fork.copy_status == "pending"  # its files are still in the parent's directory
    state = comparable(store.state(fork.id, rehydrate=True))
    events = store.read(fork.id, rehydrate=True)

    store.delete_session(sid)
    assert store.gc_blobs(apply=True, grace=0).deleted == 0  # the fork references them all

    kept = store.get_session(fork.id)
    assert (kept.parent_id, kept.copy_status) == (sid, "copied")
    assert comparable(store.state(fork.id, rehydrate=True)) == state
    assert store.read(fork.id, rehydrate=True) == events
    assert store.resolve("artifact://0", session_id=fork.id).content.startswith("full output")
    assert store.artifacts(fork.id).files.get("notes/plan.md") == b"# the plan"
    assert store.resolve("agent://0-review", session_id=fork.id).content == "# review"


def test_deleting_a_pending_fork(store: SessionStore) -> None:
    sid = _with_files(store)
    defer_copies(store)
    fork = store.fork(sid)
    store.delete_session(fork.id)
    assert store.pending_forks(older_than_s=0) == []
    assert store.artifacts(sid).files.get("notes/plan.md") == b"# the plan"


# --- the CLI, as a subprocess -----------------------------------------------------------------


def _cli(settings: Settings, *argv: str) -> Any:
    done = run_cli("sessions", *argv, "--json", env=store_env(settings))
    assert done.returncode == 0, done.stderr
    return orjson.loads(done.stdout)


@FILE_ONLY  # filesystem mechanics; S3: test_artifacts_s3_moves.py
@pytest.mark.parametrize("backend", ["sqlite"])
def test_cli_fork_show_move_delete(store: SessionStore, settings: Settings) -> None:
    sid = _with_files(store)

    queued = _cli(settings, "fork", sid, "--at-seq", "5")  # inherits artifact 0 only
    assert (queued["parent_id"], queued["forked_from_seq"]) == (sid, 5)
    assert queued["copy_status"] == "pending"  # handed to the (embedded) queue; no worker runs
    assert _cli(settings, "show", queued["id"])["copy_status"] == "pending"
    copied = _cli(settings, "copy-artifacts", queued["id"])
    assert (copied["status"], copied["copied"]) == ("copied", 1)

    inline = _cli(settings, "fork", sid, "--inline")
    assert _cli(settings, "show", inline["id"])["copy_status"] == "copied"

    moved = _cli(settings, "move", sid, "--tenant", "globex", "--cwd", "/w")
    assert (moved["tenant_id"], moved["cwd"]) == ("globex", "/w")
    deleted = _cli(settings, "delete", sid, "--yes")
    assert (deleted["events"], sorted(deleted["forks"])) == (
        9,
        sorted([queued["id"], inline["id"]]),
    )
    assert store.get_session(inline["id"]).parent_id == sid


@FILE_ONLY  # filesystem mechanics; S3: test_artifacts_s3_moves.py
@pytest.mark.parametrize("kind", ["tool output", "agent output", "oversized output"])
def test_an_artifact_write_racing_a_move_lands_in_the_moved_directory(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    sid = store.create_session(tenant_id="acme").id
    store.artifacts(sid).files.put("notes.md", "the directory exists")
    old_dir = session_dir(store.settings.resolved_artifact_root, "acme", sid)
    # The move lands after the content is staged and before the write takes its lock.
    staged_init = fsio.StagedFile.__init__
    moves: list[Any] = []

    def stage_then_move(
        self: fsio.StagedFile, session_root: Path, data: bytes, **options: Any
    ) -> None:
        staged_init(self, session_root, data, **options)
        if not moves:
            moves.append(store.move(sid, tenant_id="globex"))

    monkeypatch.setattr(fsio.StagedFile, "__init__", stage_then_move)
    content = "z" * 13_000
    artifacts = store.artifacts(sid)
    if kind == "tool output":
        url = f"artifact://{artifacts.save(content, 'bash')}"
    elif kind == "agent output":
        url = f"agent://{artifacts.save_agent_output('review', content)}"
    else:
        stored = store.store_oversized(sid, content, "grep")
        assert stored is not None
        url = stored.ref.artifact_id
    assert moves and store.get_session(sid).tenant_id == "globex"
    assert store.resolve(url, session_id=sid).content == content
    assert not old_dir.exists()  # nothing was written where the session used to be
    assert not list((store.artifacts(sid).directory() / ".tmp").glob("*.tmp"))


@FILE_ONLY  # filesystem mechanics; S3: test_artifacts_s3_moves.py
def test_a_move_between_reading_the_directory_and_staging_loses_nothing(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staging re-creates the path the session just left; the write still lands in the new
    directory and the re-created leftovers are removed (a move back must not find them)."""
    sid = store.create_session(tenant_id="acme").id
    store.artifacts(sid).files.put("notes.md", "the directory exists")
    old_dir = session_dir(store.settings.resolved_artifact_root, "acme", sid)
    write_temp = fsio.write_temp
    moves: list[Any] = []

    def move_then_stage(session_root: Path, data: bytes) -> Path:
        if not moves:
            moves.append(store.move(sid, tenant_id="globex"))
        return write_temp(session_root, data)

    monkeypatch.setattr(fsio, "write_temp", move_then_stage)
    artifact_id = store.artifacts(sid).save("z" * 100, "bash")
    monkeypatch.undo()

    assert moves and store.resolve(f"artifact://{artifact_id}", session_id=sid).content == "z" * 100
    assert not old_dir.exists()
    assert store.move(sid, tenant_id="acme").tenant_id == "acme"  # and back again
    assert store.resolve(f"artifact://{artifact_id}", session_id=sid).content == "z" * 100
