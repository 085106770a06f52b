"""Fork: events and state at the fork point, forks of forks, counters, quotas and resume
(issue 6), on SQLite and PostgreSQL."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import delete, event, func, select

from core import SessionNotFound, SessionStore, Settings
from core.artifacts.objects import ObjectArtifactStorage
from core.errors import ArtifactNotFound, InvalidForkPoint, QuotaExceeded, StorageUnavailable
from core.interop.omp import export_omp
from core.models import ArtifactRow, BlobRefRow, EventRow, table_of
from core.query.snapshots import list_snapshots
from core.query.state import SessionState
from core.records import Session
from core.sessions.fork_copy import pending_forks_query
from tasks.cli.samples import EntryBuilder, screenshot_png
from tests.contract.artifact_backends import (
    FILE_ONLY,
    RawArtifacts,
    artifact_backend,
    raw,
    settings,
)
from tests.support import set_output_expiry

__all__ = ["FILE_ONLY", "RawArtifacts", "artifact_backend", "raw", "settings"]

_artifacts = table_of(ArtifactRow)
BIG_OUTPUT = "collected 412 items\n" + "tests/test_upload.py::test_retry PASSED\n" * 600


def build_session(store: SessionStore, session_id: str, turns: int = 6) -> list[int]:
    """A coding-agent session with screenshots and big tool outputs (blobs), a branch and a
    tool-output artifact per turn; returns the head after each turn."""
    b = EntryBuilder()
    artifacts = store.artifacts(session_id)
    store.append(session_id, [b.session_info("fix the upload test"), b.thinking_level("high")])
    heads: list[int] = []
    branch_point = ""
    for turn in range(turns):
        call = f"call_{turn}"
        user = b.user(f"turn {turn}: look at the failure", images=[screenshot_png(turn % 3)])
        branch_point = branch_point or user["id"]
        events = [
            user,
            b.assistant(
                f"running the tests ({turn})", tool_calls=[(call, "bash", {"cmd": "pytest"})]
            ),
            b.tool_result(call, "bash", BIG_OUTPUT + str(turn)),
        ]
        if turn == turns // 2:
            b.branch_from(branch_point)
            events.append(b.assistant("trying another approach"))
        heads.append(store.append(session_id, events).last_seq)
        artifacts.save(f"full output of turn {turn}\n" + BIG_OUTPUT, "bash")
    return heads


def comparable(state: SessionState) -> dict[str, Any]:
    """The state without what names the session itself."""
    data = state.to_dict()
    data.pop("session_id")
    data["info"].pop("parent_id")
    data["info"].pop("forked_from_seq")
    return data


def defer_copies(store: SessionStore) -> list[Session]:
    """Leave fork copies pending (as if the queue had them); returns the forks handed over."""
    handed: list[Session] = []
    store.fork_copier = handed.append
    return handed


class CopyFault:
    """Fault injection at a fork copy's copy step, on either artifact store: the file
    store's copy fails with ``errno`` (by default a full disk), the object store's
    server-side copy as an unreachable service (``StorageUnavailable``). The first
    ``times`` copies fail (None: every one until ``cleared``)."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, *, code: int = errno.ENOSPC, times: int | None = None
    ) -> None:
        self.code, self.left, self.failed = code, times, 0
        real_copyfileobj, real_copy = shutil.copyfileobj, ObjectArtifactStorage.copy

        def copyfileobj(*args: Any, **kwargs: Any) -> None:
            self._fail(OSError(self.code, os.strerror(self.code)))
            real_copyfileobj(*args, **kwargs)

        def copy(storage: ObjectArtifactStorage, source: str, target: str) -> None:
            self._fail(StorageUnavailable("artifacts", "artifacts is unavailable: injected"))
            real_copy(storage, source, target)

        monkeypatch.setattr(shutil, "copyfileobj", copyfileobj)
        monkeypatch.setattr(ObjectArtifactStorage, "copy", copy)

    def cleared(self) -> None:
        self.left = 0

    def _fail(self, exc: Exception) -> None:
        if self.left is None or self.left > 0:
            self.left = None if self.left is None else self.left - 1
            self.failed += 1
            raise exc


def _count(store: SessionStore, table: Any, session_id: str) -> int:
    with store.engine.connect() as conn:
        query = select(func.count()).select_from(table).where(table.c.session_id == session_id)
        return int(conn.execute(query).scalar_one())


# --- events and state at the fork point ---------------------------------------------------------


@pytest.mark.parametrize("where", ["head", "earlier"])
def test_fork_rebuilds_the_parents_state_at_the_fork_point(store: SessionStore, where: str) -> None:
    parent = store.create_session(tenant_id="acme", title="upload", cwd="/work/upload")
    heads = build_session(store, parent.id)
    at_seq = None if where == "head" else heads[2]
    point = heads[-1] if at_seq is None else at_seq
    expected = comparable(store.state(parent.id, at_seq=point, rehydrate=True))
    blobs_before = store.blob_stats().blob_count
    last_parent_position = store.read(parent.id)[-1].position

    fork = store.fork(parent.id, at_seq=at_seq)

    assert (fork.parent_id, fork.forked_from_seq, fork.head_seq) == (parent.id, point, point)
    assert (fork.tenant_id, fork.title, fork.cwd) == ("acme", "upload", "/work/upload")
    assert comparable(store.state(fork.id, rehydrate=True)) == expected
    # Same payloads and manifest, new positions after everything that was there; no blob copied.
    parent_events = store.read(parent.id, upto_seq=point)
    fork_events = store.read(fork.id)
    assert [(e.seq, e.type, e.payload) for e in fork_events] == [
        (e.seq, e.type, e.payload) for e in parent_events
    ]
    assert {e.recorded_at for e in fork_events} == {fork.created_at}
    positions = [e.position for e in fork_events]
    assert positions == sorted(positions) and positions[0] > last_parent_position
    assert [e.payload for e in store.read(fork.id, rehydrate=True)] == [
        e.payload for e in store.read(parent.id, upto_seq=point, rehydrate=True)
    ]
    refs = _count(store, BlobRefRow.__table__, fork.id)  # type: ignore[attr-defined]
    assert refs > 0
    assert store.blob_stats().blob_count == blobs_before

    # Later parent events are invisible to the fork.
    store.append(parent.id, [EntryBuilder().user("only in the parent")])
    assert store.get_session(fork.id).head_seq == point
    assert comparable(store.state(fork.id, rehydrate=True)) == expected


def test_forks_of_forks(store: SessionStore) -> None:
    parent = store.create_session(tenant_id="acme")
    heads = build_session(store, parent.id, turns=4)
    first = store.fork(parent.id, at_seq=heads[1])
    b = EntryBuilder(counter=1000)
    store.append(first.id, [b.user("only in the first fork"), b.assistant("sure")])
    store.artifacts(first.id).save("first fork's own output", "bash")
    first_head = store.get_session(first.id).head_seq
    expected = comparable(store.state(first.id, rehydrate=True))

    second = store.fork(first.id)
    third = store.fork(second.id, at_seq=heads[0])

    assert comparable(store.state(second.id, rehydrate=True)) == expected
    assert store.get_session(second.id).head_seq == first_head
    assert comparable(store.state(third.id, rehydrate=True)) == comparable(
        store.state(parent.id, at_seq=heads[0], rehydrate=True)
    )
    assert store.resolve("artifact://2", session_id=second.id).content == (
        "first fork's own output"
    )


def test_fork_points_outside_the_session_are_refused(store: SessionStore) -> None:
    parent = store.create_session(tenant_id="acme")
    store.append(parent.id, [EntryBuilder().user("one")])
    for at_seq in (-1, 2):
        with pytest.raises(InvalidForkPoint, match="the head is 1"):
            store.fork(parent.id, at_seq=at_seq)
    with pytest.raises(SessionNotFound):
        store.fork("no-such-session")
    with pytest.raises(SessionNotFound):
        store.fork(parent.id, tenant_id="globex")
    assert store.list_sessions().items == [store.get_session(parent.id)]


def test_fork_at_zero_is_an_empty_session_of_the_same_tenant(store: SessionStore) -> None:
    parent = store.create_session(tenant_id="acme")
    build_session(store, parent.id, turns=1)
    fork = store.fork(parent.id, at_seq=0)
    assert (fork.head_seq, fork.forked_from_seq, fork.copy_status) == (0, 0, "copied")
    assert store.read(fork.id) == []
    assert store.append(fork.id, [EntryBuilder().user("fresh start")]).first_seq == 1


def test_fork_copies_the_parents_snapshots_up_to_the_fork_point(settings: Settings) -> None:
    with SessionStore.from_settings(settings.with_overrides(snapshot_every=5)) as store:
        parent = store.create_session(tenant_id="acme")
        heads = build_session(store, parent.id, turns=6)
        for head in heads:
            store.state(parent.id, at_seq=head)  # each read stores the last boundary it passed
        fork = store.fork(parent.id, at_seq=heads[3])
        parent_seqs = [seq for _, seq, _ in list_snapshots(store.engine, parent.id)]
        fork_seqs = [seq for _, seq, _ in list_snapshots(store.engine, fork.id)]
        assert fork_seqs == [s for s in parent_seqs if s <= heads[3]] and fork_seqs
        assert comparable(store.state(fork.id, rehydrate=True)) == comparable(
            store.state(parent.id, at_seq=heads[3], rehydrate=True)
        )


def test_concurrent_appends_to_the_parent_never_leak_into_a_fork(store: SessionStore) -> None:
    parent = store.create_session(tenant_id="acme")
    b = EntryBuilder()
    store.append(parent.id, [b.user("start")])
    done = threading.Event()

    def writer() -> None:
        for i in range(150):
            store.append(parent.id, [b.user(f"message {i}")])
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    forks: list[Session] = []
    while not done.is_set() or not forks:
        forks.append(store.fork(parent.id))
    thread.join()
    parent_payloads = [e.payload for e in store.read(parent.id)]
    for fork in forks:
        events = store.read(fork.id)
        assert [e.seq for e in events] == list(range(1, fork.head_seq + 1))
        assert [e.payload for e in events] == parent_payloads[: fork.head_seq]


# --- artifacts: ids, status, quota ------------------------------------------------------------


def test_fork_counters_continue_after_the_ids_at_the_fork_point(store: SessionStore) -> None:
    parent = store.create_session(tenant_id="acme")
    artifacts = store.artifacts(parent.id)
    b = EntryBuilder()
    for i in range(3):
        artifacts.save(f"output {i}", "bash")
    review = artifacts.save_agent_output("review", "# review")
    artifacts.save_agent_output("fixer", "# fix")
    artifacts.save_agent_output("child", "# nested", parent_id=review)
    point = store.append(parent.id, [b.user("fork here")]).last_seq
    store.append(parent.id, [b.user("later")])
    artifacts.save("after the fork point", "bash")  # id 3, created at seq point + 1
    artifacts.save_agent_output("late", "# late")  # 2-late

    fork = store.fork(parent.id, at_seq=point)
    mine = store.artifacts(fork.id)

    assert sorted(a.local_id for a in mine.list()) == sorted(
        ["0", "1", "2", "0-review", "1-fixer", "0-review.0-child"]
    )
    assert mine.save("fork's own", "bash") == "3"
    assert mine.save_agent_output("other", "# other") == "2-other"
    assert mine.save_agent_output("kid", "# kid", parent_id=review) == "0-review.1-kid"
    # Resolving: inherited ids are the parent's content, the new ones the fork's.
    assert store.resolve("artifact://2", session_id=fork.id).content == "output 2"
    assert store.resolve("artifact://3", session_id=fork.id).content == "fork's own"
    assert store.resolve("artifact://3", session_id=parent.id).content == "after the fork point"
    assert store.resolve("agent://0-review.0-child", session_id=fork.id).content == "# nested"


def test_a_fork_without_artifacts_is_copied_at_once(store: SessionStore) -> None:
    parent = store.create_session(tenant_id="acme")
    store.append(parent.id, [EntryBuilder().user("no artifacts here")])
    handed = defer_copies(store)
    fork = store.fork(parent.id)
    assert (fork.copy_status, handed) == ("copied", [])


@FILE_ONLY  # filesystem mechanics; S3: test_artifacts_s3_moves.py
def test_inherited_artifacts_are_copied_in_process_without_a_queue(store: SessionStore) -> None:
    parent = store.create_session(tenant_id="acme")
    build_session(store, parent.id, turns=2)
    fork = store.fork(parent.id)  # no fork_copier: the store copies right after the commit
    assert (fork.copy_status, fork.copy_error) == ("copied", None)
    assert store.artifacts(fork.id).directory().is_dir()


def test_a_failing_copier_leaves_the_fork_pending_and_usable(store: SessionStore) -> None:
    parent = store.create_session(tenant_id="acme")
    build_session(store, parent.id, turns=2)

    def broken(fork: Session) -> None:
        raise ConnectionError("broker unreachable")

    store.fork_copier = broken
    fork = store.fork(parent.id)
    assert store.get_session(fork.id).copy_status == "pending"
    assert store.resolve("artifact://1", session_id=fork.id).content.startswith("full output")
    assert store.pending_forks(older_than_s=0) == [fork.id]
    report = store.copy_fork_artifacts(fork.id)
    assert (report.status, report.copied) == ("copied", 2)
    assert store.copy_fork_artifacts(fork.id).copied == 0  # safe to run again
    assert store.pending_forks(older_than_s=0) == []


def test_a_pending_fork_reads_inherited_files_and_oversized_outputs(store: SessionStore) -> None:
    parent = store.create_session(tenant_id="acme")
    build_session(store, parent.id, turns=1)
    store.artifacts(parent.id).files.put("notes/plan.md", "the plan")
    stored = store.store_oversized(parent.id, "z" * 13_000, "grep")
    assert stored is not None
    oversized = stored.ref.artifact_id
    handed = defer_copies(store)
    fork = store.fork(parent.id)
    assert [f.id for f in handed] == [fork.id]
    assert not store.artifacts(fork.id).directory().exists()  # nothing copied yet

    files = store.artifacts(fork.id).files
    assert files.get("notes/plan.md") == b"the plan"
    assert store.retrieve(oversized, session_id=fork.id) == "z" * 13_000
    with pytest.raises(ArtifactNotFound):
        files.get("notes/other.md")

    # The parent rewrites its file after the fork: the fork never sees the new content,
    # and keeps what it inherited (copy-on-write of the parent's old content, issue 16).
    time.sleep(0.01)
    store.artifacts(parent.id).files.put("notes/plan.md", "the new plan")
    assert files.get("notes/plan.md") == b"the plan"

    report = store.copy_fork_artifacts(fork.id)
    assert (report.status, report.copied, report.already_present) == ("copied", 2, 1)
    assert files.get("notes/plan.md") == b"the plan"
    assert store.retrieve(oversized, session_id=fork.id) == "z" * 13_000  # its own copy now


def test_the_reconcilers_scan_is_indexed(store: SessionStore) -> None:
    query = pending_forks_query(datetime.now(UTC), 100)
    sql = str(query.compile(store.engine, compile_kwargs={"literal_binds": True}))
    with store.engine.connect() as conn:
        if store.engine.dialect.name == "sqlite":
            plan = " ".join(str(r[-1]) for r in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}"))
        else:  # on an empty table a scan is cheapest: ask whether the index can serve it
            conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
            plan = " ".join(str(r[0]) for r in conn.exec_driver_sql(f"EXPLAIN {sql}"))
    assert "ix_sessions_copy_status_created" in plan, plan


def test_a_fork_that_would_exceed_the_tenant_quota_is_refused(
    settings: Settings,
) -> None:
    with SessionStore.from_settings(settings.with_overrides(quota_tenant_bytes=1500)) as store:
        parent = store.create_session(tenant_id="acme")
        store.append(parent.id, [EntryBuilder().user("hi")])
        store.artifacts(parent.id).files.put("notes/plan.md", "x" * 1000)
        with pytest.raises(QuotaExceeded, match="tenant quota exceeded"):
            store.fork(parent.id)
        assert len(store.list_sessions().items) == 1
        assert _count(store, EventRow.__table__, parent.id) == 1  # type: ignore[attr-defined]


# --- resume -----------------------------------------------------------------------------------


def test_reopening_continues_seq_artifact_ids_and_agent_output_ids(settings: Settings) -> None:
    with SessionStore.from_settings(settings) as store:
        session = store.create_session(tenant_id="acme")
        build_session(store, session.id, turns=2)
        first_agent = store.artifacts(session.id).save_agent_output("review", "# first")
        fork = store.fork(session.id)
        head = store.get_session(session.id).head_seq
    with SessionStore.from_settings(settings) as reopened:
        for sid in (session.id, fork.id):
            result = reopened.append(sid, [EntryBuilder(counter=500).user("back again")])
            assert result.first_seq == head + 1
            artifacts = reopened.artifacts(sid)
            assert artifacts.save("after reopening", "bash") == "2"
            assert artifacts.save_agent_output("review", "# second") == "1-review"
            # Nothing was overwritten.
            assert reopened.resolve("artifact://0", session_id=sid).content.startswith(
                "full output of turn 0"
            )
            assert reopened.resolve(f"agent://{first_agent}", session_id=sid).content == "# first"


@FILE_ONLY  # filesystem mechanics; S3: test_artifacts_s3_moves.py
def test_a_failed_copy_keeps_serving_unchanged_inherited_artifacts_and_a_retry_completes(
    store: SessionStore,
) -> None:
    parent = store.create_session(tenant_id="acme")
    build_session(store, parent.id, turns=1)
    stored = store.store_oversized(parent.id, "z" * 13_000, "grep")
    assert stored is not None
    oversized = stored.ref.artifact_id
    defer_copies(store)
    fork = store.fork(parent.id)
    # A real filesystem failure: a file sits where the fork's oversized/ directory goes.
    fork_dir = store.artifacts(fork.id).directory()
    fork_dir.mkdir(parents=True)
    (fork_dir / "oversized").write_text("in the way")

    report = store.copy_fork_artifacts(fork.id)

    assert (report.status, report.copied) == ("failed", 1)
    failed = store.get_session(fork.id)
    assert failed.copy_error is not None and f"oversized {oversized}" in failed.copy_error
    assert store.resolve(oversized, session_id=fork.id).content == "z" * 13_000  # from the parent
    assert store.pending_forks(older_than_s=0) == []  # the reconciler leaves failed copies alone

    (fork_dir / "oversized").unlink()
    retried = store.copy_fork_artifacts(fork.id)
    assert (retried.status, retried.copied, retried.already_present) == ("copied", 1, 1)
    assert (fork_dir / "oversized" / f"{oversized}.txt").read_text() == "z" * 13_000


def test_a_copy_meeting_a_storage_outage_stays_pending_and_a_retry_completes_it(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk (on S3: the store unreachable) during the copy is transient: the copy
    stays pending with the reason, raises ``StorageUnavailable`` (the queue's task retries
    on that type) and is found by the reconciler. It ended "failed" for good: no exception
    for the task to retry, and the reconciler looks at pending copies only."""
    parent = store.create_session(tenant_id="acme")
    build_session(store, parent.id, turns=2)
    defer_copies(store)
    fork = store.fork(parent.id)
    fault = CopyFault(monkeypatch)

    with pytest.raises(StorageUnavailable, match="stays pending"):
        store.copy_fork_artifacts(fork.id)
    pending = store.get_session(fork.id)
    assert pending.copy_status == "pending"
    assert pending.copy_error is not None and "tool_output 0" in pending.copy_error
    assert store.pending_forks(older_than_s=0) == [fork.id]
    assert store.resolve("artifact://1", session_id=fork.id).content.startswith("full output")

    fault.cleared()
    report = store.copy_fork_artifacts(fork.id)
    assert (report.status, report.error, report.copied) == ("copied", None, 2)
    assert store.get_session(fork.id).copy_error is None
    store.delete_session(parent.id)
    assert store.resolve("artifact://0", session_id=fork.id).content.startswith(
        "full output of turn 0"
    )


def test_a_fork_copied_in_process_during_an_outage_is_left_pending(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a queue the store copies right after the fork's commit: an outage then
    leaves the committed fork usable and its copy pending (the fork call does not fail)."""
    parent = store.create_session(tenant_id="acme")
    build_session(store, parent.id, turns=1)
    CopyFault(monkeypatch)
    fork = store.fork(parent.id)
    assert (fork.copy_status, store.pending_forks(older_than_s=0)) == ("pending", [fork.id])
    assert store.resolve("artifact://0", session_id=fork.id).content.startswith("full output")


@FILE_ONLY  # the object store reports every failure but a missing object as unavailable
def test_a_permanent_error_at_the_copy_still_ends_it_failed(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A permission the deployment lacks is no outage: no retry repairs it."""
    parent = store.create_session(tenant_id="acme")
    build_session(store, parent.id, turns=1)
    defer_copies(store)
    fork = store.fork(parent.id)
    CopyFault(monkeypatch, code=errno.EACCES)
    report = store.copy_fork_artifacts(fork.id)
    assert report.status == "failed" and "Permission denied" in (report.error or "")
    assert store.pending_forks(older_than_s=0) == []


def test_a_fork_of_a_pending_fork_keeps_every_artifact_through_both_copies(
    store: SessionStore,
) -> None:
    """Grandchild G is forked while its parent C's own copy is still pending; C's copy then
    runs (on S3 a server-side copy, whose objects get a new last-modified time), then G's.
    G must find everything C inherited, and keep it when P and C change or go."""
    parent = store.create_session(tenant_id="acme")
    build_session(store, parent.id, turns=2)
    store.artifacts(parent.id).files.put("notes/plan.md", "the plan")
    stored = store.store_oversized(parent.id, "z" * 13_000, "grep")
    assert stored is not None
    handed = defer_copies(store)
    child = store.fork(parent.id)
    grandchild = store.fork(child.id)
    assert [f.id for f in handed] == [child.id, grandchild.id]
    time.sleep(1.2)  # object stores keep last-modified in whole seconds
    first = store.copy_fork_artifacts(child.id)
    assert (first.status, first.error, first.missing_at_source) == ("copied", None, 0)
    second = store.copy_fork_artifacts(grandchild.id)
    assert (second.status, second.error, second.missing_at_source) == ("copied", None, 0), second
    assert second.copied == first.copied
    # P rewrites and deletes, C goes: G keeps what it had at its fork point
    store.artifacts(parent.id).files.put("notes/plan.md", "the new plan")
    store.delete_session(child.id)
    store.delete_session(parent.id)
    files = store.artifacts(grandchild.id).files
    assert files.get("notes/plan.md") == b"the plan"
    assert store.retrieve(stored.ref.artifact_id, session_id=grandchild.id) == "z" * 13_000
    assert store.resolve("artifact://1", session_id=grandchild.id).content.startswith("full output")


def test_a_fork_of_a_copied_fork_copies_from_it(store: SessionStore) -> None:
    """C's copy is finished before G is forked: G's copy reads C's objects, which on S3 are
    newer than P's originals but older than G."""
    parent = store.create_session(tenant_id="acme")
    build_session(store, parent.id, turns=1)
    store.artifacts(parent.id).files.put("notes/plan.md", "the plan")
    handed = defer_copies(store)
    child = store.fork(parent.id)
    time.sleep(1.2)
    assert store.copy_fork_artifacts(child.id).status == "copied"
    time.sleep(1.2)
    grandchild = store.fork(child.id)
    assert [f.id for f in handed] == [child.id, grandchild.id]
    store.delete_session(parent.id)
    report = store.copy_fork_artifacts(grandchild.id)
    assert (report.status, report.error, report.missing_at_source) == ("copied", None, 0)
    store.delete_session(child.id)
    assert store.artifacts(grandchild.id).files.get("notes/plan.md") == b"the plan"


@pytest.mark.parametrize("parent_keeps", [True, False], ids=["copied", "lost"])
def test_a_copys_queries_do_not_grow_with_the_artifacts_it_inherited(
    store: SessionStore, parent_keeps: bool
) -> None:
    """A fork's copy plans every inherited artifact with a fixed number of queries. It
    looked up the parent's session and the parent's row for each artifact, and judged each
    one the parent no longer holds by its own reading of the database's clock (PostgreSQL):
    three queries a row. Now the parent's rows are read at once, its session once, and the
    clock once. What is lost stays lost: outputs the parent no longer holds fail the copy,
    naming them, but for one expired meanwhile (nobody could read it anyway)."""

    def queries_of_a_copy(outputs: int) -> tuple[int, str | None]:
        parent = store.create_session(tenant_id="acme")
        ids = []
        for n in range(outputs):
            stored = store.store_oversized(parent.id, f"{n}" * 13_000, "grep")
            assert stored is not None
            ids.append(stored.ref.artifact_id)
        defer_copies(store)
        fork = store.fork(parent.id)
        if not parent_keeps:  # removed from the parent behind the fork's back
            with store.engine.begin() as conn:
                conn.execute(delete(_artifacts).where(_artifacts.c.session_id == parent.id))
            set_output_expiry(store, ids[0], timedelta(seconds=-1))  # expired: not lost
        statements: list[str] = []

        def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            statements.append(statement)

        event.listen(store.engine, "before_cursor_execute", count)
        try:
            report = store.copy_fork_artifacts(fork.id)
        finally:
            event.remove(store.engine, "before_cursor_execute", count)
        expected = ("copied", outputs) if parent_keeps else ("failed", 0)
        assert (report.status, report.copied) == expected
        return len(statements), store.get_session(fork.id).copy_error

    few, few_error = queries_of_a_copy(2)
    many, many_error = queries_of_a_copy(6)
    if not parent_keeps:
        assert few_error is not None and few_error.count("changed or removed in the parent") == 1
        assert many_error is not None
        assert many_error.count("changed or removed in the parent") == 5
    assert many == few


def test_a_pending_forks_export_has_the_sidecars_it_inherited(
    store: SessionStore, tmp_path: Path
) -> None:
    """A fork whose copy is unfinished exports the agent outputs it inherited with their
    JSONL sidecars, read (and checked) where the markdown is read from."""
    parent = store.create_session(tenant_id="acme")
    store.append(parent.id, [EntryBuilder().user("delegate")])
    output_id = store.artifacts(parent.id).save_agent_output("worker", "# done", jsonl="{}\n")
    defer_copies(store)
    fork = store.fork(parent.id)
    done = export_omp(store, fork.id, tmp_path / "out", blobs_dir=tmp_path / "blobs")
    assert (done.artifacts_dir / f"{output_id}.jsonl").read_text() == "{}\n"
    assert (done.artifacts_dir / f"{output_id}.md").read_text() == "# done"
