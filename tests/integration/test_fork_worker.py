"""The fork's artifact copy through the queue: a real worker, real Redis, real PostgreSQL.

- with a worker, inherited artifacts arrive byte-identical, as independent files;
- with the worker stopped, the pending fork resolves its inherited artifacts from the
  parent, and the parent's later writes never show through;
- a lost copy task is recovered by the reconciler;
- a copy meeting a storage outage is retried by its task, and past its retries, completed
  by the reconciler.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from celery.result import AsyncResult

from core import SessionStore, Settings
from core.artifacts import session_dir
from core.artifacts.paths import agent_output_names
from tasks.app import create_app
from tasks.cli.samples import EntryBuilder
from tasks.forks import COPY_TASK, RECONCILE_TASK
from tasks.runtime import attach_fork_copier
from tests.contract.test_fork import BIG_OUTPUT, CopyFault, defer_copies
from tests.support import thread_worker, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


@pytest.fixture
def queue_settings(queue_settings: Settings) -> Settings:
    return queue_settings.with_overrides(fork_copy_timeout_seconds=0.5)


@pytest.fixture
def app(queue_settings: Settings) -> Celery:
    return create_app(queue_settings)


@pytest.fixture
def store(queue_settings: Settings, app: Celery) -> Iterator[SessionStore]:
    with SessionStore.from_settings(queue_settings) as s:
        yield attach_fork_copier(s, app)


def _parent(store: SessionStore) -> tuple[str, dict[str, str]]:
    """A session with every kind of artifact; returns its id and the inherited URLs."""
    sid = store.create_session(tenant_id="acme").id
    b = EntryBuilder()
    artifacts = store.artifacts(sid)
    store.append(sid, [b.user("start")])
    tool = artifacts.save(BIG_OUTPUT, "bash")
    store.append(sid, [b.assistant("ran the tests")])
    review = artifacts.save_agent_output("review", "# review\nlooks good", jsonl='{"step": 1}\n')
    nested = artifacts.save_agent_output("check", '{"ok": true, "n": [1, 2]}', parent_id=review)
    artifacts.files.put("src/app/notes.md", "# notes\n")
    stored = store.store_oversized(sid, "y" * 13_000, "grep")
    assert stored is not None
    store.append(sid, [b.user("fork after this")])
    urls = {
        f"artifact://{tool}": BIG_OUTPUT,
        f"agent://{review}": "# review\nlooks good",
        f"agent://{nested}": '{"ok": true, "n": [1, 2]}',
        stored.ref.artifact_id: "y" * 13_000,
    }
    return sid, urls


def _directory(store: SessionStore, session_id: str) -> Path:
    tenant = store.get_session(session_id).tenant_id
    return session_dir(store.settings.resolved_artifact_root, tenant, session_id)


def _files(directory: Path) -> dict[str, Path]:
    return {
        str(p.relative_to(directory)): p
        for p in directory.rglob("*")
        if p.is_file() and ".tmp" not in p.parts
    }


def _wait_copied(store: SessionStore, fork_id: str, timeout: float = 60) -> None:
    wait_for(
        lambda: store.get_session(fork_id).copy_status != "pending", timeout, "the fork's copy"
    )


def test_a_worker_copies_inherited_artifacts_byte_identical(
    app: Celery, store: SessionStore
) -> None:
    sid, urls = _parent(store)
    with thread_worker(app):
        fork = store.fork(sid)
        assert fork.copy_status == "pending"
        _wait_copied(store, fork.id)
    assert store.get_session(fork.id).copy_status == "copied"

    parent_files = _files(_directory(store, sid))
    fork_files = _files(_directory(store, fork.id))
    assert set(fork_files) == set(parent_files)
    assert "0-review.jsonl" in fork_files  # the agent output's sidecar came along
    for name, path in fork_files.items():
        assert path.read_bytes() == parent_files[name].read_bytes(), name
        # An independent file: no hard link shared with the parent.
        assert path.stat().st_nlink == 1
        assert path.stat().st_ino != parent_files[name].stat().st_ino
    for url, content in urls.items():
        assert store.resolve(url, session_id=fork.id).content == content

    # New artifacts in the fork continue the numbering; the parent's later writes stay there.
    mine = store.artifacts(fork.id)
    assert mine.save("the fork's own output", "bash") == "1"
    assert mine.save_agent_output("fixer", "# fix") == "1-fixer"
    store.artifacts(sid).files.put("src/app/notes.md", "# rewritten in the parent\n")
    assert mine.files.get("src/app/notes.md") == b"# notes\n"


def test_a_pending_fork_resolves_inherited_artifacts_with_the_worker_stopped(
    app: Celery, store: SessionStore
) -> None:
    sid, urls = _parent(store)
    fork = store.fork(sid)  # enqueued to Redis; no worker is consuming

    time.sleep(1.0)
    assert store.get_session(fork.id).copy_status == "pending"
    assert not _directory(store, fork.id).exists()
    for url, content in urls.items():
        assert store.resolve(url, session_id=fork.id).content == content
    assert store.resolve("agent://0-review.0-check/n/1", session_id=fork.id).content == "2"
    # The fork's own new artifact gets the next id and lives in its own directory.
    assert store.artifacts(fork.id).save("fork's own", "bash") == "1"
    assert store.resolve("artifact://1", session_id=fork.id).content == "fork's own"
    assert store.resolve("artifact://0", session_id=fork.id).content == BIG_OUTPUT

    with thread_worker(app):
        _wait_copied(store, fork.id)
    assert store.get_session(fork.id).copy_status == "copied"
    for url, content in urls.items():
        assert store.resolve(url, session_id=fork.id).content == content
    assert store.artifacts(fork.id).files.get("src/app/notes.md") == b"# notes\n"


def test_parent_rewrites_after_the_fork_never_show_through(
    app: Celery, store: SessionStore
) -> None:
    """Issue 16, item 7: the parent's rewrite while the fork's copy is pending never shows
    through, and never costs the fork its fork-point content (copy-on-write), before and
    after a real worker runs the copy."""
    sid, urls = _parent(store)
    fork = store.fork(sid)
    time.sleep(0.1)  # past the fork's creation, for any filesystem clock granularity
    # Same size: the row stays identical; only the file is newer than the fork.
    store.artifacts(sid).write_agent_output("0-review", "# REVIEW\nLOOKS GOOD")
    assert store.resolve("agent://0-review", session_id=sid).content == "# REVIEW\nLOOKS GOOD"

    assert store.resolve("agent://0-review", session_id=fork.id).content == "# review\nlooks good"
    with thread_worker(app):
        _wait_copied(store, fork.id)

    after = store.get_session(fork.id)
    assert after.copy_status == "copied", after.copy_error
    fork_dir = _directory(store, fork.id)
    md, sidecar = agent_output_names("0-review")
    assert (fork_dir / md).read_text() == "# review\nlooks good"
    assert (fork_dir / sidecar).read_text() == '{"step": 1}\n'
    for url, content in urls.items():
        assert store.resolve(url, session_id=fork.id).content == content
    assert store.append(fork.id, [EntryBuilder(counter=50).user("go on")]).first_seq == 4
    assert store.artifacts(fork.id).save("more", "bash") == "1"


def test_a_lost_copy_task_is_recovered_by_the_reconciler(app: Celery, store: SessionStore) -> None:
    sid, urls = _parent(store)
    handed = defer_copies(store)  # the process died between the commit and the enqueue
    fork = store.fork(sid)
    assert [f.id for f in handed] == [fork.id]
    with thread_worker(app):
        time.sleep(1.0)
        assert store.get_session(fork.id).copy_status == "pending"  # nobody knows about it
        assert store.pending_forks(older_than_s=0.5) == [fork.id]
        outcome = app.send_task(RECONCILE_TASK)
        wait_for(outcome.ready, 30, "the reconciler")
        assert outcome.result["ran"] and outcome.result["job"] == "reconcile_forks"
        report = outcome.result["report"]
        assert report["requeued"] == 1 and report["fork_ids"] == [fork.id]
        _wait_copied(store, fork.id)
        ran = [True]
        again = _run_reconciler(app)
        if again.result["slot"] != outcome.result["slot"]:
            # The period ended between the two runs (a minute's slots): that run was the
            # new period's first, and ran; one more is in its period.
            assert again.result["ran"]
            ran.append(True)
            outcome, again = again, _run_reconciler(app)
        assert again.result["slot"] == outcome.result["slot"]  # same period: one run
        assert not again.result["ran"] and again.result["report"] is None
        ran.append(False)
    # every execution is in the run log `sessionstore maintenance-runs` reads
    runs = store.maintenance_runs.recent(job="reconcile_forks")
    assert [r.ran for r in reversed(runs)] == ran
    assert runs[-1].report["report"]["fork_ids"] == [fork.id]
    assert store.get_session(fork.id).copy_status == "copied"
    for url, content in urls.items():
        assert store.resolve(url, session_id=fork.id).content == content


def _run_reconciler(app: Celery) -> AsyncResult:
    outcome = app.send_task(RECONCILE_TASK)
    wait_for(outcome.ready, 30, "the reconciler run")
    return outcome


def _reconcile_until_sent(app: Celery, fork_id: str) -> None:
    """One reconciler run that re-enqueues the fork (a run in a used period is skipped)."""

    def sent() -> bool:
        outcome = app.send_task(RECONCILE_TASK)
        wait_for(outcome.ready, 30, "the reconciler")
        return bool((outcome.result.get("report") or {}).get("fork_ids") == [fork_id])

    wait_for(sent, 30, "a reconciler run", step=0.2)


def test_a_link_planted_in_the_fork_keeps_its_copy_pending_until_it_is_removed(
    queue_settings: Settings, tmp_path: Path
) -> None:
    """A link where one inherited file goes: the reconciler's copy skips that file (copies
    the rest) and leaves the copy pending; once the link is removed, the next reconciler
    run completes it with the parent's bytes."""
    settings = queue_settings.with_overrides(reconcile_schedule="1")
    app = create_app(settings)
    (tmp_path / "secret.txt").write_text("SECRET")
    with SessionStore.from_settings(settings) as plain:
        store = attach_fork_copier(plain, app)
        sid, urls = _parent(store)
        defer_copies(store)
        fork = store.fork(sid)
        fork_dir = _directory(store, fork.id)
        log_name = next(n for n in _files(_directory(store, sid)) if n.endswith(".bash.log"))
        fork_dir.mkdir(parents=True)
        os.symlink(tmp_path / "secret.txt", fork_dir / log_name)
        with thread_worker(app):
            time.sleep(1.0)  # older than the copy timeout
            _reconcile_until_sent(app, fork.id)
            wait_for(lambda: store.get_session(fork.id).copy_error is not None, 30, "the copy")
            assert store.get_session(fork.id).copy_status == "pending"
            assert "symlink" in (store.get_session(fork.id).copy_error or "")
            assert (fork_dir / "files" / "src" / "app" / "notes.md").read_text() == "# notes\n"

            (fork_dir / log_name).unlink()
            _reconcile_until_sent(app, fork.id)
            _wait_copied(store, fork.id)
        assert store.get_session(fork.id).copy_status == "copied"
        assert (fork_dir / log_name).read_text() == BIG_OUTPUT
        for url, content in urls.items():
            assert store.resolve(url, session_id=fork.id).content == content
    assert (tmp_path / "secret.txt").read_text() == "SECRET"


def test_a_copy_meeting_a_full_disk_is_retried_by_its_task(
    app: Celery, store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk is full for the first two attempts: the task retries (the copy raised
    ``StorageUnavailable``) and the third completes it. It ended "failed" at once."""
    sid, urls = _parent(store)
    fault = CopyFault(monkeypatch, times=2)
    with thread_worker(app):
        fork = store.fork(sid)
        wait_for(lambda: store.get_session(fork.id).copy_status == "copied", 60, "the copy")
    assert fault.failed == 2
    assert store.get_session(fork.id).copy_error is None
    store.delete_session(sid)
    for url, content in urls.items():
        assert store.resolve(url, session_id=fork.id).content == content


def test_a_copy_left_pending_by_an_outage_is_completed_by_the_reconciler(
    queue_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk stays full past the task's retries (none here): the copy stays pending with
    the reason, and the reconciler's run after the disk has room again completes it."""
    settings = queue_settings.with_overrides(reconcile_schedule="1", task_max_retries=0)
    app = create_app(settings)
    with SessionStore.from_settings(settings) as plain:
        store = attach_fork_copier(plain, app)
        sid, urls = _parent(store)
        fault = CopyFault(monkeypatch)
        with thread_worker(app):
            fork = store.fork(sid)
            wait_for(lambda: store.get_session(fork.id).copy_error is not None, 30, "the copy")
            failed = store.get_session(fork.id)
            assert failed.copy_status == "pending", failed.copy_error
            assert "No space left" in (failed.copy_error or "")

            fault.cleared()
            time.sleep(1.0)  # older than the copy timeout
            _reconcile_until_sent(app, fork.id)
            _wait_copied(store, fork.id)
        assert store.get_session(fork.id).copy_status == "copied"
        for url, content in urls.items():
            assert store.resolve(url, session_id=fork.id).content == content


def test_the_copy_task_is_idempotent_and_never_overwrites(app: Celery, store: SessionStore) -> None:
    sid, _ = _parent(store)
    defer_copies(store)
    fork = store.fork(sid)
    # The fork writes its own version of an inherited file before the copy runs.
    store.artifacts(fork.id).files.put("src/app/notes.md", "# the fork's notes\n")
    with thread_worker(app):
        results = [app.send_task(COPY_TASK, kwargs={"fork_id": fork.id}) for _ in range(3)]
        for result in results:
            wait_for(result.ready, 30, "a copy task")
    reports = [r.result for r in results]
    assert all(r["status"] == "copied" for r in reports)
    assert (
        sum(r["copied"] for r in reports) == 4
    )  # each file once: tool, agent (+jsonl), nested, oversized
    assert store.artifacts(fork.id).files.get("src/app/notes.md") == b"# the fork's notes\n"
    with thread_worker(app):
        gone = app.send_task(COPY_TASK, kwargs={"fork_id": "no-such-fork"})
        wait_for(gone.ready, 30, "a copy of a missing fork")
    assert gone.result == {"fork_id": "no-such-fork", "status": None}
