"""An oversized output's discard removes its file outside every database lock (a slow or
hung S3 DELETE held SQLite's one write lock, or the tenant's quota lock on PostgreSQL), and
still removes it where the session is when a move races it, at every step.

Each test runs on both journals and both artifact backends (file:// and s3:// on moto).
The steps are driven by hooks and threading events, never by sleeps: a hook first checks,
without waiting, that another writer could take the lock now, so the old code (which
removed the file inside its transaction) fails there instead of deadlocking.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from core import SessionStore
from core.artifacts import rows as artifact_rows
from core.artifacts.objects import ObjectArtifactStorage
from core.artifacts.oversized import OversizedOutputs
from core.artifacts.paths import oversized_name, session_dir
from core.artifacts.storage import key_of
from core.errors import ArtifactBusy
from core.sessions.moves import Moves
from tests.contract.artifact_backends import (
    FILE_ONLY,
    RawArtifacts,
    artifact_backend,
    raw,
    settings,
)

__all__ = ["artifact_backend", "raw", "settings"]  # every test runs on file:// and s3://


def writers_can_proceed(store: SessionStore, tenant_id: str) -> bool:
    """Whether another writer could take the lock a discard used to hold, now, without
    waiting: SQLite's write lock, or the tenant's quota lock on PostgreSQL."""
    if store.engine.dialect.name == "sqlite":
        database = store.engine.url.database
        assert database is not None
        probe = sqlite3.connect(database, timeout=0, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:  # "database is locked", at once
            assert "locked" in str(exc)
            return False
        else:
            probe.execute("ROLLBACK")
            return True
        finally:
            probe.close()
    key = artifact_rows._QUOTA_LOCK_PREFIX + tenant_id
    with store.engine.connect() as conn, conn.begin():
        query = text("SELECT pg_try_advisory_xact_lock(hashtext(:key))")
        return bool(conn.execute(query, {"key": key}).scalar_one())


def _oversized(store: SessionStore, sid: str, marker: str) -> tuple[str, str]:
    content = f"{marker} " * 7000
    stored = store.store_oversized(sid, content, "bash")
    assert stored is not None
    return stored.ref.artifact_id, content


def _path(raw: RawArtifacts, tenant: str, sid: str, artifact_id: str) -> Path:
    return session_dir(raw.root, tenant, sid) / oversized_name(artifact_id)


def test_a_blocked_removal_holds_no_lock(
    store: SessionStore, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The removal hangs (a slow S3 DELETE, a stalled disk) until released: meanwhile an
    append to another session commits, and another output of the same tenant is stored
    (it takes the tenant's quota lock); the discard then completes."""
    sid = store.create_session(tenant_id="acme").id
    other = store.create_session(tenant_id="acme").id
    art, _ = _oversized(store, sid, "gone")
    entered, release = threading.Event(), threading.Event()
    real = OversizedOutputs._remove
    outcome: dict[str, Any] = {}

    def blocked(self: OversizedOutputs, path: Path) -> None:
        outcome["blocked"] = True
        entered.set()
        release.wait()
        real(self, path)

    def discard() -> None:
        try:
            outcome["deleted"] = store.oversized.discard(sid, art)
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            entered.set()  # never leave the test waiting

    monkeypatch.setattr(OversizedOutputs, "_remove", blocked)
    worker = threading.Thread(target=discard)
    worker.start()
    try:
        entered.wait()
        assert outcome.get("blocked") and worker.is_alive()
        assert writers_can_proceed(store, "acme")  # the old code held the lock here
        appended = store.append(other, [{"type": "note", "text": "while S3 hangs"}])
        assert appended.last_seq == 1
        kept, content = _oversized(store, other, "kept")
        assert worker.is_alive() and "deleted" not in outcome  # still blocked in the removal
    finally:
        release.set()
        worker.join()
    assert outcome == {"blocked": True, "deleted": True}
    assert raw.gone(_path(raw, "acme", sid, art))
    assert store.oversized.stats().count == 1
    assert store.retrieve(kept, session_id=other) == content


# Where a move runs, relative to the discard's steps (1: read the place under the lock;
# 2: remove the file, no lock; 3: re-check under the lock and delete the row).
BEFORE_REMOVAL = "move between steps 1 and 2"
AFTER_REMOVAL = "move between steps 2 and 3"
RELOCATED = "removal inside the move, after its rename/copy, then the move commits"
UNDONE = "removal inside the move, after its rename/copy, then the move fails and is undone"
S3_LISTED = "s3: removal after the move listed the objects, before it copied them"
S3_COPIED = "s3: removal after the move copied the objects, before it deleted the sources"
S3_COPIED_UNDONE = "s3: removal after the copies, then the move fails and is undone"
SCENARIOS = [BEFORE_REMOVAL, AFTER_REMOVAL, RELOCATED, UNDONE]
S3_SCENARIOS = [S3_LISTED, S3_COPIED, S3_COPIED_UNDONE]
S3_ONLY = pytest.mark.parametrize("artifact_backend", ["s3"])


class MoveFailedOnPurpose(OSError):
    pass


def _inside_the_move(
    monkeypatch: pytest.MonkeyPatch, scenario: str, key: str, removal: Callable[[], None]
) -> None:
    """Make the next move run ``removal`` at the scenario's point (once), and fail after
    its relocation for the undone scenarios."""
    fired: list[bool] = []

    def fire() -> None:
        if not fired:
            fired.append(True)
            removal()

    real_mover = Moves._mover

    def mover(self: Moves, source: str, target: str, session_id: str) -> Any:
        made = real_mover(self, source, target, session_id)
        run = made.run

        def run_then() -> None:
            run()
            if scenario in (RELOCATED, UNDONE):
                fire()
            if scenario in (UNDONE, S3_COPIED_UNDONE):
                raise MoveFailedOnPurpose("commit never happens")

        made.run = run_then  # type: ignore[method-assign]
        return made

    monkeypatch.setattr(Moves, "_mover", mover)
    if scenario == S3_LISTED:
        real_copy = ObjectArtifactStorage.copy

        def copy(self: ObjectArtifactStorage, source: str, target: str) -> None:
            if source == key:
                fire()  # the object goes before its copy: the move skips it
            real_copy(self, source, target)

        monkeypatch.setattr(ObjectArtifactStorage, "copy", copy)
    elif scenario in (S3_COPIED, S3_COPIED_UNDONE):  # the marker follows the last copy
        real_put = ObjectArtifactStorage.put

        def put(self: ObjectArtifactStorage, target: str, data: bytes) -> None:
            real_put(self, target, data)
            if target.endswith("/move-complete"):
                fire()

        monkeypatch.setattr(ObjectArtifactStorage, "put", put)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_move_racing_the_discard_at_each_step(
    store: SessionStore, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch, scenario: str
) -> None:
    """The session moves (or tries to) at each step of the discard: the output is removed
    where the session is, its row goes, nothing is left under either tenant, and the
    session's other output and another session's output stay whole."""
    _race(store, raw, monkeypatch, scenario)


@S3_ONLY
@pytest.mark.parametrize("scenario", S3_SCENARIOS)
def test_a_move_racing_the_discard_inside_the_object_copy(
    store: SessionStore, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch, scenario: str
) -> None:
    """On S3 a move is copy, marker, delete: the removal lands between those steps."""
    _race(store, raw, monkeypatch, scenario)


def _race(
    store: SessionStore, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch, scenario: str
) -> None:
    sid = store.create_session(tenant_id="acme").id
    neighbour = store.create_session(tenant_id="acme").id
    art, _ = _oversized(store, sid, "gone")
    kept, kept_text = _oversized(store, sid, "kept")
    theirs, their_text = _oversized(store, neighbour, "theirs")
    undone = scenario in (UNDONE, S3_COPIED_UNDONE)
    real = OversizedOutputs._remove
    calls: list[Path] = []

    def move() -> None:
        if undone:
            with pytest.raises(MoveFailedOnPurpose):
                store.move(sid, tenant_id="globex")
        else:
            store.move(sid, tenant_id="globex")

    def hooked(self: OversizedOutputs, path: Path) -> None:
        calls.append(path)
        if len(calls) > 1:  # the next rounds: no more moves
            real(self, path)
            return
        assert writers_can_proceed(store, "acme")  # the old code removed under the lock
        if scenario == BEFORE_REMOVAL:
            move()
            real(self, path)
        elif scenario == AFTER_REMOVAL:
            real(self, path)
            move()
        else:
            _inside_the_move(
                monkeypatch, scenario, key_of(raw.root, path), lambda: real(self, path)
            )
            move()

    monkeypatch.setattr(OversizedOutputs, "_remove", hooked)
    assert store.oversized.discard(sid, art) is True

    tenant = "acme" if undone else "globex"
    assert store.get_session(sid).tenant_id == tenant
    assert len(calls) == 2  # the move was seen: removed again where the session is now
    assert calls[1] == _path(raw, tenant, sid, art)
    for place in ("acme", "globex"):
        assert raw.gone(_path(raw, place, sid, art)), place
    assert raw.keys_under(session_dir(raw.root, tenant, sid)) == [
        key_of(raw.root, _path(raw, tenant, sid, kept))
    ]
    moved_from = "globex" if undone else "acme"
    assert raw.keys_under(session_dir(raw.root, moved_from, sid)) == []
    assert store.retrieve(art, session_id=sid) is None
    assert store.retrieve(kept, session_id=sid) == kept_text
    assert store.retrieve(theirs, session_id=neighbour) == their_text
    assert store.oversized.stats().count == 2
    assert store._moves.pending() == []
    assert store.oversized.discard(sid, art) is False


def test_a_pending_move_defers_the_discard(store: SessionStore, raw: RawArtifacts) -> None:
    """A move whose intent is recorded but not settled (a crash between its intent and its
    commit): the files' place is not known, so the discard removes nothing and keeps the
    row (typed ``ArtifactBusy``, reported by expiry); once the move is repaired, it goes."""
    sid = store.create_session(tenant_id="acme").id
    art, content = _oversized(store, sid, "later")
    store._moves._record_intent(sid, "globex", None)

    with pytest.raises(ArtifactBusy, match=art):
        store.oversized.discard(sid, art)
    assert store.retrieve(art, session_id=sid) == content

    (repair,) = store.repair_moves()
    assert repair.outcome == "rolled_back"
    assert store.oversized.discard(sid, art) is True
    assert raw.gone(_path(raw, "acme", sid, art)) and store.oversized.stats().count == 0


def test_a_pending_fork_keeps_an_output_its_parent_discards(store: SessionStore) -> None:
    """Its row says the output is there: the discard gives the fork its own copy first (as
    a file's delete does), so the fork reads it, and its copy finishes instead of failing
    on a file "changed or removed in the parent"."""
    store.fork_copier = lambda fork: None  # the queue has not run the fork's copy yet
    parent = store.create_session(tenant_id="acme")
    store.append(parent.id, [{"type": "custom", "n": 1}])
    artifact_id, content = _oversized(store, parent.id, "inherited")
    fork = store.fork(parent.id)
    assert fork.copy_status == "pending"
    assert store.artifacts(parent.id).cleanup_oversized() == 1
    assert store.retrieve(artifact_id, session_id=parent.id) is None
    assert store.retrieve(artifact_id, session_id=fork.id) == content
    report = store.copy_fork_artifacts(fork.id)
    assert (report.status, report.error) == ("copied", None)
    assert store.retrieve(artifact_id, session_id=fork.id) == content


@FILE_ONLY
@pytest.mark.parametrize("pending_fork", [False, True])
def test_a_symlink_planted_at_a_discarded_output_is_left_and_the_row_goes(
    store: SessionStore, raw: RawArtifacts, tmp_path: Path, pending_fork: bool
) -> None:
    """Keeping an output for a pending fork never follows (or is stopped by) a link planted
    in its place: its target is untouched, and the row goes, fork or not (a first try at
    keeping it stopped every discard of the row at the link, for good)."""
    store.fork_copier = lambda fork: None
    parent = store.create_session(tenant_id="acme")
    store.append(parent.id, [{"type": "custom", "n": 1}])
    artifact_id, _ = _oversized(store, parent.id, "linked")
    if pending_fork:
        store.fork(parent.id)
    secret = tmp_path / "secret"
    secret.write_text("not the store's")
    path = _path(raw, "acme", parent.id, artifact_id)
    path.unlink()
    path.symlink_to(secret)
    assert store.oversized.discard(parent.id, artifact_id) is True
    assert secret.read_text() == "not the store's"
    assert store.retrieve(artifact_id, session_id=parent.id) is None
    assert [a for a in store.artifacts(parent.id).list() if a.local_id == artifact_id] == []
