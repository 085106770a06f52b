"""A fork taken while its parent is still writing an artifact: a tool output streaming
(``writing``), or an agent output allocated and not written yet. The fork inherits what
existed at its creation, and neither had content then (the tool's result, which would name
the output, comes after the fork point): the fork holds a ``truncated`` tool output of 0
bytes (readers are told it is not the whole output) and an unwritten agent-output slot of
its own. The parent's finishing them later is not a change to what the fork inherited: its
copy completes, whenever it runs. On both journals and both artifact stores."""

from __future__ import annotations

from datetime import timedelta

import pytest

from core import SessionStore
from core.artifacts import rows
from core.artifacts.records import TRUNCATED, AllocatedPath
from core.errors import ArtifactIncomplete, ResolveNotFound
from core.maintenance.expiry import expire_artifacts
from core.models import utcnow
from tests.contract.artifact_backends import RawArtifacts, artifact_backend, raw, settings
from tests.contract.test_fork import defer_copies

__all__ = ["artifact_backend", "raw", "settings"]

FILE = b"alpha at the fork"
FIRST, SECOND = b"first half of the log\n", b"second half, after the fork\n"


def _streaming_parent(store: SessionStore) -> tuple[str, AllocatedPath]:
    """A parent with a file and a tool output half written (its writer still running)."""
    parent = store.create_session(tenant_id="acme")
    store.append(parent.id, [{"type": "custom", "n": 1}])
    manager = store.artifacts(parent.id)
    manager.files.put("a.txt", FILE)
    allocated = manager.allocate_path("bash")
    allocated.path.write_bytes(FIRST)  # the tool's own write (on S3: the local spool file)
    return parent.id, allocated


def _finish(store: SessionStore, parent_id: str, allocated: AllocatedPath) -> None:
    with allocated.path.open("ab") as log:
        log.write(SECOND)
    store.artifacts(parent_id).finalize_tool_output(allocated.id)


@pytest.mark.parametrize("copy_runs", ["before", "after"])
def test_a_fork_taken_while_a_tool_output_streams_holds_none_of_it_and_its_copy_completes(
    store: SessionStore, copy_runs: str
) -> None:
    """Fails before: the fork's row said ``writing`` as the parent's did, and once the
    parent finished the output the fork's copy failed for good ("1 of 2 inherited
    artifacts were not copied: tool_output N: changed or removed in the parent"); a copy
    that ran first took the half-written bytes, under a row no writer would finish."""
    parent_id, allocated = _streaming_parent(store)
    defer_copies(store)
    fork = store.fork(parent_id)
    if copy_runs == "before":
        report = store.copy_fork_artifacts(fork.id)
        assert (report.status, report.error, report.copied) == ("copied", None, 1)
    _finish(store, parent_id, allocated)

    report = store.copy_fork_artifacts(fork.id)
    assert (report.status, report.error) == ("copied", None)
    url = f"artifact://{allocated.id}"
    assert store.resolve(url, session_id=parent_id).content == (FIRST + SECOND).decode()
    with pytest.raises(ArtifactIncomplete) as refused:
        store.resolve(url, session_id=fork.id)
    assert (refused.value.state, refused.value.size_bytes) == (TRUNCATED, 0)
    partial = store.resolve(url, session_id=fork.id, partial=True)
    assert (partial.content, partial.complete) == ("", False)

    store.delete_session(parent_id)
    assert store.artifacts(fork.id).files.get("a.txt") == FILE
    assert int(store.artifacts(fork.id).allocate_path("bash").id) > int(allocated.id)


def test_expiry_never_takes_a_forks_copy_of_an_output_streaming_in_its_parent_for_a_dead_writer(
    store: SessionStore,
) -> None:
    """The fork's row is settled at the fork: a copy that runs while the parent's tool is
    still writing takes none of its bytes, and expiry, which settles the outputs of writers
    silent for longer than the staging age, has nothing of the fork's to settle. Fails
    before: the fork's row said ``writing`` with no writer of its own, the copy took the
    half-written bytes, and expiry marked them ``truncated`` in the fork as a dead writer's."""
    parent_id, allocated = _streaming_parent(store)
    fork = store.fork(parent_id)  # copied at once: no queue here
    assert store.get_session(fork.id).copy_status == "copied"
    with store.engine.connect() as conn:
        held = rows.get_artifact(conn, fork.id, "tool_output", allocated.id)
        assert held is not None and (held.state, held.size_bytes) == (TRUNCATED, 0)
        assert rows.inherited_keys(conn, fork.id) == {("file", "a.txt")}

    later = utcnow() + timedelta(seconds=store.settings.staging_max_age_seconds + 5)
    swept = expire_artifacts(store.engine, store.oversized, apply=True, now=later)
    assert swept.stale_writes_truncated == 1  # the parent's (its writer silent that long)
    _finish(store, parent_id, allocated)  # it was only slow: finished after all
    with store.engine.connect() as conn:
        finished = rows.get_artifact(conn, parent_id, "tool_output", allocated.id)
        assert finished is not None and finished.complete
        assert finished.size_bytes == len(FIRST + SECOND)
        held = rows.get_artifact(conn, fork.id, "tool_output", allocated.id)
        assert held is not None and (held.state, held.size_bytes) == (TRUNCATED, 0)


def test_a_fork_taken_before_an_allocated_agent_output_is_written_has_a_slot_of_its_own(
    store: SessionStore, raw: RawArtifacts
) -> None:
    """The parent writes the output after the fork: the fork's copy completes (fails
    before: "agent_output 1-explorer: changed or removed in the parent"), the parent's
    content never shows through in the fork, and the fork can write the slot itself."""
    parent = store.create_session(tenant_id="acme")
    store.append(parent.id, [{"type": "custom", "n": 1}])
    manager = store.artifacts(parent.id)
    manager.files.put("a.txt", FILE)
    slot = manager.allocate_agent_output("explorer")
    defer_copies(store)
    fork = store.fork(parent.id)
    manager.write_agent_output(slot.id, "# the parent's findings", jsonl='{"step": 1}\n')
    url = f"agent://{slot.id}"
    with pytest.raises(ResolveNotFound):
        store.resolve(url, session_id=fork.id)  # pending: nothing from the parent

    report = store.copy_fork_artifacts(fork.id)
    assert (report.status, report.error, report.copied) == ("copied", None, 1)
    with pytest.raises(ResolveNotFound):
        store.resolve(url, session_id=fork.id)
    store.artifacts(fork.id).write_agent_output(slot.id, "# the fork's own")
    assert store.resolve(url, session_id=fork.id).content == "# the fork's own"
    assert store.resolve(url, session_id=parent.id).content == "# the parent's findings"


def _settle_as_dead(store: SessionStore) -> None:
    """Expiry, as if the parent's writer had been silent for longer than the staging age."""
    later = utcnow() + timedelta(seconds=store.settings.staging_max_age_seconds + 5)
    swept = expire_artifacts(store.engine, store.oversized, apply=True, now=later)
    assert swept.stale_writes_truncated == 1


def _holds_none_of_it(store: SessionStore, fork_id: str, allocated: AllocatedPath) -> None:
    url = f"artifact://{allocated.id}"
    partial = store.resolve(url, session_id=fork_id, partial=True)
    assert (partial.content, partial.complete) == ("", False)
    with store.engine.connect() as conn:
        held = rows.get_artifact(conn, fork_id, "tool_output", allocated.id)
    assert held is not None and (held.state, held.size_bytes) == (TRUNCATED, 0)


def test_a_fork_of_an_output_expiry_truncated_survives_its_writer_finishing_after_all(
    store: SessionStore, raw: RawArtifacts
) -> None:
    """The parent's writer was only slow: expiry marked its output ``truncated``, a fork
    was taken, then the writer wrote on and finalized. The fork holds none of it (what it
    would hold grows in the parent) and its copy completes. Fails before: the fork
    inherited the truncated row, read the bytes written after the fork (on files), and its
    copy failed for good once the parent's row became ``complete``."""
    parent_id, allocated = _streaming_parent(store)
    _settle_as_dead(store)
    defer_copies(store)
    fork = store.fork(parent_id)
    with allocated.path.open("ab") as log:
        log.write(SECOND)  # the slow writer goes on, after the fork
    _holds_none_of_it(store, fork.id, allocated)
    store.artifacts(parent_id).finalize_tool_output(allocated.id)

    report = store.copy_fork_artifacts(fork.id)
    assert (report.status, report.error, report.copied) == ("copied", None, 1)
    _holds_none_of_it(store, fork.id, allocated)
    url = f"artifact://{allocated.id}"
    assert store.resolve(url, session_id=parent_id).content == (FIRST + SECOND).decode()
    directory = store.artifacts(fork.id).directory()
    assert not raw.exists(directory / f"{allocated.id}.bash.log")


@pytest.mark.parametrize("finish", ["finalize", "put"])
def test_a_forks_own_row_identical_to_its_parents_later_one_never_reads_the_parents_bytes(
    store: SessionStore, raw: RawArtifacts, finish: str
) -> None:
    """A tool that has written nothing at the fork, silent for longer than the staging
    age: expiry settles the parent's row as ``truncated`` at 0 bytes, the very row the fork
    took as its own. What the writer writes after that is the parent's only, and so is an
    output put anew over it. Fails before (files): the pending fork read the writer's bytes
    and its copy took them, its row saying 0 bytes; the parent's put gave the fork a link
    to them (``preserve_for_forks`` served the identical row)."""
    parent = store.create_session(tenant_id="acme")
    store.append(parent.id, [{"type": "custom", "n": 1}])
    manager = store.artifacts(parent.id)
    manager.files.put("a.txt", FILE)
    allocated = manager.allocate_path("bash")  # no byte written yet
    defer_copies(store)
    fork = store.fork(parent.id)
    _settle_as_dead(store)
    allocated.path.write_bytes(SECOND)  # the slow writer's output, after both
    _holds_none_of_it(store, fork.id, allocated)

    if finish == "put":  # the parent's output put anew, over the file it names, while
        # the fork's copy is pending: the parent's write keeps nothing for the fork
        manager.put_tool_output(allocated.id, "bash", "the parent's, put anew")
        _holds_none_of_it(store, fork.id, allocated)
    report = store.copy_fork_artifacts(fork.id)
    assert (report.status, report.error, report.copied) == ("copied", None, 1)
    if finish == "finalize":
        manager.finalize_tool_output(allocated.id)
    _holds_none_of_it(store, fork.id, allocated)
    directory = store.artifacts(fork.id).directory()
    assert not raw.exists(directory / f"{allocated.id}.bash.log")
