"""A fork's inherited artifacts whatever the hosts' clocks say: several hosts share the
database and the artifact store (a bucket, or a shared filesystem), and what a fork
inherited is decided by its rows' content (their SHA-256), never by one host's clock
against another's. The writer's clock ahead of the forking host's made an unchanged file
look rewritten after the fork (the fork's copy failed, its inherited files lost); behind,
a rewrite during the copy passed as inherited. On both artifact stores, and both journals;
the copy's steps are the object store's calls (on files, its opens of the sources)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest

from core import SessionStore
from core.artifacts import rows
from core.artifacts.objects import ObjectArtifactStorage
from core.artifacts.paths import session_dir
from core.artifacts.storage import key_of
from core.errors import StorageUnavailable
from core.maintenance.expiry import expire_artifacts
from core.models import utcnow
from core.records import Session
from core.sessions import fork_copy
from tests.contract.artifact_backends import RawArtifacts, artifact_backend, raw, settings
from tests.contract.test_fork import defer_copies
from tests.support import skew_host_clock

__all__ = ["artifact_backend", "raw", "settings"]

S3_ONLY = pytest.mark.parametrize("artifact_backend", ["s3"])
# The copy's steps are the artifact store's calls, the same whichever journal holds the
# rows: the step-by-step matrices run on one (every other test here runs on both).
ONE_JOURNAL = pytest.mark.parametrize("backend", ["sqlite"])
# The writer's clock ahead of the forking host's, and behind it
SKEWS = pytest.mark.parametrize(
    "writer_ahead", [timedelta(minutes=5), -timedelta(minutes=5)], ids=["ahead", "behind"]
)
FILE = b"alpha at the fork"
MARKDOWN, SIDECAR, TOOL_LOG = "# findings at the fork", '{"step": 1}\n', "tool log at the fork"


def _parent(store: SessionStore) -> tuple[str, str]:
    """A parent with a file, an agent output with its JSONL sidecar and a tool output."""
    parent = store.create_session(tenant_id="acme")
    store.append(parent.id, [{"type": "custom", "n": 1}])
    manager = store.artifacts(parent.id)
    manager.files.put("a.txt", FILE)
    output_id = manager.save_agent_output("explorer", MARKDOWN, jsonl=SIDECAR)
    manager.put_tool_output("7", "bash", TOOL_LOG)
    return parent.id, output_id


def _fork_elsewhere(store: SessionStore, parent_id: str, writer_ahead: timedelta) -> Session:
    """A fork made on a host whose clock is ``writer_ahead`` behind the writer's; its copy
    left pending."""
    defer_copies(store)
    with pytest.MonkeyPatch.context() as host:
        skew_host_clock(host, -writer_ahead)
        fork = store.fork(parent_id)
    assert store.get_session(fork.id).copy_status == "pending"
    return fork


def _rewrite_at_the_same_size(store: SessionStore, parent_id: str, output_id: str) -> None:
    manager = store.artifacts(parent_id)
    manager.files.put("a.txt", b"A" * len(FILE))
    manager.write_agent_output(output_id, "#" * len(MARKDOWN), jsonl="[" * len(SIDECAR))
    manager.put_tool_output("7", "bash", "T" * len(TOOL_LOG))


def _assert_inherited(store: SessionStore, raw: RawArtifacts, fork_id: str, output_id: str) -> None:
    """The fork serves what it inherited, sidecar included (on its own objects once
    copied: then checked in the store itself)."""
    assert store.artifacts(fork_id).files.get("a.txt") == FILE
    assert store.resolve(f"agent://{output_id}", session_id=fork_id).content == MARKDOWN
    assert store.resolve("artifact://7", session_id=fork_id).content == TOOL_LOG
    if store.get_session(fork_id).copy_status == "copied":
        directory = session_dir(raw.root, "acme", fork_id)
        assert raw.read(directory / "files" / "a.txt") == FILE
        assert raw.text(directory / f"{output_id}.md") == MARKDOWN
        assert raw.text(directory / f"{output_id}.jsonl") == SIDECAR
        assert raw.keys_under(directory / ".tmp") == []  # no staged copy left behind


@SKEWS
def test_a_fork_copies_and_serves_unchanged_artifacts_whatever_the_writers_clock(
    store: SessionStore, raw: RawArtifacts, writer_ahead: timedelta
) -> None:
    """Fails before with the writer ahead: the pending fork found nothing to read, and its
    copy failed with every artifact "changed or removed in the parent"."""
    parent_id, output_id = _parent(store)
    fork = _fork_elsewhere(store, parent_id, writer_ahead)
    _assert_inherited(store, raw, fork.id, output_id)  # while pending: from the parent

    report = store.copy_fork_artifacts(fork.id)
    assert (report.status, report.error, report.copied) == ("copied", None, 3)
    store.delete_session(parent_id)
    _assert_inherited(store, raw, fork.id, output_id)


@SKEWS
def test_a_parent_rewrite_after_the_fork_never_shows_through_whatever_the_writers_clock(
    store: SessionStore, raw: RawArtifacts, writer_ahead: timedelta
) -> None:
    """Same-size rewrites of every rewritable kind after the fork: the parent's writes give
    the pending fork its own copy first. Fails before with the writer ahead: they took the
    unchanged objects for rewritten ones and kept nothing for the fork (lost)."""
    parent_id, output_id = _parent(store)
    fork = _fork_elsewhere(store, parent_id, writer_ahead)
    _rewrite_at_the_same_size(store, parent_id, output_id)
    _assert_inherited(store, raw, fork.id, output_id)

    report = store.copy_fork_artifacts(fork.id)
    assert (report.status, report.error) == ("copied", None)
    store.delete_session(parent_id)
    _assert_inherited(store, raw, fork.id, output_id)


class StepHook:
    """Runs ``action`` before the ``step``-th call the fork's copy makes to the object
    store (HEAD, copy, read, delete; any one of ``ObjectArtifactStorage``'s methods) or,
    on the file store, before its ``step``-th open of a source, once; ``steps`` counts
    them. Only calls inside ``_run_copy`` count: the plan and the parent's own writes pass
    untouched."""

    METHODS = ("size", "version", "copy", "read", "open_read", "delete", "put")

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, step: int, action: Callable[[], None]
    ) -> None:
        self.step, self.action, self.steps = step, action, 0
        self.fired: str | None = None  # the method it ran before
        self._inside = False
        for name in self.METHODS:
            real = getattr(ObjectArtifactStorage, name, None)
            if real is None:
                continue  # not every version of the store has them all
            monkeypatch.setattr(ObjectArtifactStorage, name, self._hooked(name, real))
        monkeypatch.setattr(fork_copy, "open_file", self._hooked("open", fork_copy.open_file))
        real_run = fork_copy._run_copy

        def run(*args: Any, **kwargs: Any) -> Any:
            with self._counting():
                return real_run(*args, **kwargs)

        monkeypatch.setattr(fork_copy, "_run_copy", run)

    @contextmanager
    def _counting(self) -> Iterator[None]:
        self._inside = True
        try:
            yield
        finally:
            self._inside = False

    def _hooked(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._inside:
                self._inside = False  # the action's own calls, and a method's inner ones
                try:
                    self.steps += 1
                    if self.steps == self.step:
                        self.fired = name
                        self.action()
                    return real(*args, **kwargs)
                finally:
                    self._inside = True
            return real(*args, **kwargs)

        return call


# enough to reach every call of a copy of three artifacts (four objects), and past it
STEPS = pytest.mark.parametrize("step", range(1, 27))


@S3_ONLY
@ONE_JOURNAL
@SKEWS
@STEPS
def test_a_parent_rewriting_during_the_copy_never_puts_its_new_bytes_in_the_fork(
    store: SessionStore,
    raw: RawArtifacts,
    monkeypatch: pytest.MonkeyPatch,
    writer_ahead: timedelta,
    step: int,
) -> None:
    """The race the copy guards: the parent rewrites (same sizes) at each step of the fork's
    copy. The fork ends with what it inherited, or with a typed failure naming the change
    that a re-run heals; never with the new bytes. Fails before: with the writer ahead the
    copy loses everything; behind, a rewrite between its checks and its server-side copy
    put the new bytes over the copy the parent's write had kept for the fork."""
    parent_id, output_id = _parent(store)
    fork = _fork_elsewhere(store, parent_id, writer_ahead)
    hook = StepHook(
        monkeypatch, step, lambda: _rewrite_at_the_same_size(store, parent_id, output_id)
    )

    report = store.copy_fork_artifacts(fork.id)
    if not hook.fired:  # past the copy's last step: the rewrite comes after it
        _rewrite_at_the_same_size(store, parent_id, output_id)
    if report.status == "failed":
        assert report.error is not None and "changed in the parent" in report.error
        retried = store.copy_fork_artifacts(fork.id)
        assert (retried.status, retried.error) == ("copied", None), retried
    else:
        assert (report.status, report.error) == ("copied", None), report
    store.delete_session(parent_id)
    _assert_inherited(store, raw, fork.id, output_id)
    assert hook.fired or hook.steps >= 4 * 5  # every object: HEAD, copy, read, HEAD, copy


@S3_ONLY
@ONE_JOURNAL
@STEPS
def test_an_outage_at_any_step_of_the_copy_leaves_it_pending_and_a_retry_completes_it(
    store: SessionStore, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch, step: int
) -> None:
    """The object store away at one step of the copy: the copy stays pending and raises
    ``StorageUnavailable`` (the task retries it); the retry copies everything whole, and
    no staged copy is left behind, but by an outage at its removal: expiry sweeps that."""
    parent_id, output_id = _parent(store)
    fork = _fork_elsewhere(store, parent_id, timedelta(0))

    def outage() -> None:
        raise StorageUnavailable("artifacts", "artifacts is unavailable: injected")

    hook = StepHook(monkeypatch, step, outage)
    try:
        first = store.copy_fork_artifacts(fork.id)
    except StorageUnavailable:
        assert hook.fired and store.get_session(fork.id).copy_status == "pending"
        _assert_inherited(store, raw, fork.id, output_id)  # still served meanwhile
        monkeypatch.undo()
        first = store.copy_fork_artifacts(fork.id)
    assert (first.status, first.error) == ("copied", None), first
    if hook.fired == "delete":  # the staged copy was not removed: expiry sweeps it
        later = utcnow() + timedelta(seconds=store.settings.staging_max_age_seconds + 5)
        swept = expire_artifacts(store.engine, store.oversized, apply=True, now=later)
        assert swept.stale_temp_files == 1
    store.delete_session(parent_id)
    _assert_inherited(store, raw, fork.id, output_id)


def test_a_parent_file_that_is_not_its_rows_content_is_never_copied_into_a_fork(
    store: SessionStore, raw: RawArtifacts
) -> None:
    """The parent's file overwritten behind its row (same size), by a host whose clock is
    behind the forking host's: the fork's copy fails naming it and keeps nothing under its
    name; the others are copied. Fails before on S3: copied, the wrong bytes kept silently
    (its write time older than the fork)."""
    parent_id, _output_id = _parent(store)
    fork = _fork_elsewhere(store, parent_id, timedelta(0))
    parent_file = session_dir(raw.root, "acme", parent_id) / "files" / "a.txt"
    real = time.time
    with pytest.MonkeyPatch.context() as host:
        host.setattr(time, "time", lambda: real() - 600)
        raw.storage.put(key_of(raw.root, parent_file), b"B" * len(FILE))

    report = store.copy_fork_artifacts(fork.id)
    assert report.status == "failed" and report.copied == 2
    assert report.error is not None and "file a.txt: changed in the parent" in report.error
    fork_dir = session_dir(raw.root, "acme", fork.id)
    assert not raw.exists(fork_dir / "files" / "a.txt")
    assert raw.keys_under(fork_dir / ".tmp") == []


@ONE_JOURNAL
@SKEWS
@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("depth", ["child", "grandchild"])
def test_a_rewrite_racing_the_copy_never_reaches_a_fork_or_a_fork_of_a_pending_fork(
    store: SessionStore,
    raw: RawArtifacts,
    monkeypatch: pytest.MonkeyPatch,
    writer_ahead: timedelta,
    step: int,
    depth: str,
) -> None:
    """P rewrites at a step of a fork's copy. Its own fork C is given a copy (a link on
    files) of the old bytes first, which its copy keeps. G, forked from C while C's copy
    is pending, reads P's files, and P's rewrite keeps nothing for G (not its fork): the
    new bytes never reach G, whose copy fails naming the change, and a re-run copies from
    C. Fails before: with the writer ahead nothing is inherited; behind, G gets P's new
    bytes (on both stores)."""
    parent_id, output_id = _parent(store)
    fork = child = _fork_elsewhere(store, parent_id, writer_ahead)
    if depth == "grandchild":
        fork = _fork_elsewhere(store, child.id, writer_ahead)
    hook = StepHook(
        monkeypatch, step, lambda: _rewrite_at_the_same_size(store, parent_id, output_id)
    )

    report = store.copy_fork_artifacts(fork.id)
    assert hook.fired, report
    if depth == "grandchild":
        assert report.status == "failed", report
        assert report.error is not None and "changed in the parent" in report.error
        monkeypatch.undo()
        report = store.copy_fork_artifacts(fork.id)
    assert (report.status, report.error) == ("copied", None), report
    store.delete_session(parent_id)
    if depth == "grandchild":
        store.delete_session(child.id)
    _assert_inherited(store, raw, fork.id, output_id)


def test_an_output_rewritten_without_its_sidecar_is_copied_into_a_fork(
    store: SessionStore, raw: RawArtifacts
) -> None:
    """An agent output rewritten without a sidecar has none (its row says so), whatever
    file the earlier write left: the fork's copy neither fails on that file (it is no
    content of the row) nor serves it."""
    parent_id, output_id = _parent(store)
    store.artifacts(parent_id).write_agent_output(output_id, "# no transcript now")
    fork = _fork_elsewhere(store, parent_id, timedelta(0))
    report = store.copy_fork_artifacts(fork.id)
    assert (report.status, report.error) == ("copied", None)
    assert store.resolve(f"agent://{output_id}", session_id=fork.id).content == (
        "# no transcript now"
    )
    directory = session_dir(raw.root, "acme", fork.id)
    assert raw.read(directory / f"{output_id}.jsonl") is None


@SKEWS
def test_what_the_fork_allocates_itself_is_never_taken_for_an_inheritance_it_lost(
    store: SessionStore, raw: RawArtifacts, writer_ahead: timedelta
) -> None:
    """An agent output and a tool output the fork allocates before its first append (at the
    fork point, as its inherited rows are) on a host whose clock is behind the forking
    host's, their files not written yet: they are the fork's own, not inherited rows the
    parent changed or removed. Fails before with the writer behind: the copy failed with
    both "changed or removed in the parent", judged by the writer's clock against the
    forking host's."""
    parent_id, output_id = _parent(store)
    fork = _fork_elsewhere(store, parent_id, writer_ahead)
    manager = store.artifacts(fork.id)
    own = manager.allocate_agent_output("mine")
    allocated = manager.allocate_path("bash")

    report = store.copy_fork_artifacts(fork.id)
    assert (report.status, report.error, report.copied) == ("copied", None, 3)
    _assert_inherited(store, raw, fork.id, output_id)
    manager.write_agent_output(own.id, "# the fork's own")
    assert store.resolve(f"agent://{own.id}", session_id=fork.id).content == "# the fork's own"
    assert int(allocated.id) > 7  # numbered after what the fork inherited


def test_an_inherited_artifact_the_fork_writes_anew_is_its_own(store: SessionStore) -> None:
    """The rows a fork copied at its creation are marked inherited, in the fork only; one
    the fork writes anew (put again, or an output rewritten in place) is its own from then
    on (fails before the upsert and the rewrite clear it)."""
    parent_id, output_id = _parent(store)
    fork = _fork_elsewhere(store, parent_id, timedelta(0))
    with store.engine.connect() as conn:
        assert rows.inherited_keys(conn, parent_id) == set()
        assert rows.inherited_keys(conn, fork.id) == {
            ("file", "a.txt"),
            ("agent_output", output_id),
            ("tool_output", "7"),
        }
    manager = store.artifacts(fork.id)
    manager.files.put("a.txt", b"the fork's own")
    manager.put_tool_output("7", "bash", "the fork's own log")
    with store.engine.connect() as conn:
        assert rows.inherited_keys(conn, fork.id) == {("agent_output", output_id)}
    manager.write_agent_output(output_id, "# the fork's own", jsonl='{"step": 2}\n')
    with store.engine.connect() as conn:
        assert rows.inherited_keys(conn, fork.id) == set()
    report = store.copy_fork_artifacts(fork.id)
    assert (report.status, report.error) == ("copied", None)
    assert store.artifacts(fork.id).files.get("a.txt") == b"the fork's own"


def test_a_fork_of_a_pending_fork_does_not_lose_what_its_parent_allocated_and_never_wrote(
    store: SessionStore, raw: RawArtifacts
) -> None:
    """A fork's own agent output and tool output, allocated and not written, inherited by
    a fork of it taken while its copy is pending: no file of them was ever written, so the
    grandchild's copy has nothing to copy, and loses nothing. Fails before: its copy
    walked past the parent (which had no file) to the grandparent (which has no such row)
    and failed with both "changed or removed in the parent". (Since, neither is marked
    inherited in the grandchild at all: nothing was written of them at the fork,
    ``test_fork_inflight``.)"""
    parent_id, output_id = _parent(store)
    fork = _fork_elsewhere(store, parent_id, timedelta(0))
    manager = store.artifacts(fork.id)
    own = manager.allocate_agent_output("mine")
    allocated = manager.allocate_path("bash")
    grandchild = store.fork(fork.id)
    with store.engine.connect() as conn:
        marked = rows.inherited_keys(conn, grandchild.id)
        assert ("agent_output", output_id) in marked
        assert {("agent_output", own.id), ("tool_output", allocated.id)}.isdisjoint(marked)

    report = store.copy_fork_artifacts(grandchild.id)
    assert (report.status, report.error, report.copied) == ("copied", None, 3)
    _assert_inherited(store, raw, grandchild.id, output_id)
    report = store.copy_fork_artifacts(fork.id)
    assert (report.status, report.error, report.copied) == ("copied", None, 3)
