"""ArtifactManager: tool-output ids and logs, agent outputs, counters, metadata rows."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from core import SessionNotFound, SessionStore
from core.artifacts import agent_counter, counter_values, rows, set_counter_floor
from core.db import read_connection, write_transaction
from core.errors import ArtifactError, ArtifactNotFound, SymlinkRefused
from tests.contract.artifact_backends import (
    FILE_ONLY,
    RawArtifacts,
    artifact_backend,
    raw,
    settings,
)

__all__ = ["FILE_ONLY", "artifact_backend", "raw", "settings"]  # each test on file:// and s3://

# Backend-independent behavior: one backend is enough.
SQLITE_ONLY = pytest.mark.parametrize("backend", ["sqlite"])


def test_tool_outputs_get_sequential_ids_and_log_files(
    store: SessionStore, raw: RawArtifacts
) -> None:
    session = store.create_session(tenant_id="acme")
    manager = store.artifacts(session.id)
    assert manager.save("first", "bash") == "0"
    assert manager.save(b"second", "mcp/server:tool") == "1"
    directory = manager.directory()
    assert raw.text(directory / "0.bash.log") == "first"
    assert raw.text(directory / "1.mcp_server_tool.log") == "second"
    rows = manager.list("tool_output")
    assert [(r.local_id, r.tool_type, r.size_bytes, r.media_type) for r in rows] == [
        ("0", "bash", 5, "text/plain"),
        ("1", "mcp_server_tool", 6, "text/plain"),
    ]


def test_numbering_continues_on_resume(store: SessionStore) -> None:
    session = store.create_session(tenant_id="acme")
    store.artifacts(session.id).save("a", "bash")
    store.artifacts(session.id).save("b", "bash")
    resumed = store.artifacts(session.id)  # a new manager object, as after a restart
    assert resumed.save("c", "read") == "2"
    assert resumed.save_agent_output("explore", "x") == "0-explore"
    assert store.artifacts(session.id).save_agent_output("explore", "y") == "1-explore"


def test_ids_are_per_session(store: SessionStore) -> None:
    a = store.artifacts(store.create_session(tenant_id="acme").id)
    b = store.artifacts(store.create_session(tenant_id="acme").id)
    assert (a.save("x", "t"), b.save("y", "t"), a.save("z", "t")) == ("0", "0", "1")


def test_ids_are_never_reused_after_a_discard(store: SessionStore) -> None:
    manager = store.artifacts(store.create_session(tenant_id="acme").id)
    slot = manager.allocate_path("bash")
    manager.discard_tool_output(slot.id)
    assert manager.save("x", "bash") == "1"


@SQLITE_ONLY
def test_allocate_path_then_finalize_records_the_size(store: SessionStore) -> None:
    manager = store.artifacts(store.create_session(tenant_id="acme").id)
    slot = manager.allocate_path("python")
    assert slot.path.name == "0.python.log" and slot.path.parent.is_dir()
    slot.path.write_text("ünïcode")
    assert manager.finalize_tool_output(slot.id) == len("ünïcode".encode())
    assert manager.list()[0].size_bytes == len("ünïcode".encode())
    with pytest.raises(ArtifactNotFound):
        manager.finalize_tool_output("99")


def test_finalize_refuses_a_link_planted_at_the_allocated_path(
    store: SessionStore, raw: RawArtifacts, tmp_path: Path
) -> None:
    """The allocated path is predictable (on S3 a spool file in the data directory's
    cache): a link planted there must not make a file from outside the store the session's
    artifact. The S3 backend uploaded the link's target (a review of stop 38)."""
    secret = tmp_path / "outside.txt"
    secret.write_text("outside the data root")
    manager = store.artifacts(store.create_session(tenant_id="acme").id)
    slot = manager.allocate_path("bash")
    slot.path.symlink_to(secret)
    with pytest.raises(SymlinkRefused):
        manager.finalize_tool_output(slot.id)
    if not raw.on_files:  # on files the link is the allocated path itself
        assert not raw.exists(manager.directory() / "0.bash.log")
    assert [a.size_bytes for a in manager.list()] == [0]  # nothing recorded either


def test_an_output_streamed_across_a_move_is_finalized_whole(
    store: SessionStore, raw: RawArtifacts
) -> None:
    """The session moves to another tenant between the allocation and the finalize (the
    output still streaming): the whole output is kept, in its new directory. The S3
    backend looked for the spool file under the new tenant's name: FileNotFoundError, and
    the output sink discarded the output."""
    sid = store.create_session(tenant_id="acme").id
    slot = store.artifacts(sid).allocate_path("bash")
    with slot.path.open("w") as out:
        out.write("first half\n")
        store.move(sid, tenant_id="globex")
        out.write("second half\n")
    manager = store.artifacts(sid)
    assert manager.finalize_tool_output(slot.id) == len("first half\nsecond half\n")
    assert raw.text(manager.directory() / "0.bash.log") == "first half\nsecond half\n"
    resolved = store.resolve(f"artifact://{slot.id}", session_id=sid)
    assert resolved.content == "first half\nsecond half\n"


def test_concurrent_threads_get_distinct_ids(store: SessionStore) -> None:
    manager = store.artifacts(store.create_session(tenant_id="acme").id)
    ids: list[str] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(5):
            artifact_id = manager.save("x", "bash")
            with lock:
                ids.append(artifact_id)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(ids, key=int) == [str(i) for i in range(30)]


def test_rows_record_the_head_seq_at_creation(store: SessionStore) -> None:
    session = store.create_session(tenant_id="acme")
    manager = store.artifacts(session.id)
    manager.save("before", "bash")
    store.append(session.id, [{"type": "custom", "n": 1}, {"type": "custom", "n": 2}])
    manager.save("after", "bash")
    manager.files.put("f.txt", "x")
    manager.save_agent_output("a", "y")
    seqs = {(r.kind, r.local_id): r.created_seq for r in manager.list()}
    assert seqs == {
        ("tool_output", "0"): 0,
        ("tool_output", "1"): 2,
        ("file", "f.txt"): 2,
        ("agent_output", "0-a"): 2,
    }


def test_unknown_or_foreign_session(store: SessionStore) -> None:
    session = store.create_session(tenant_id="acme")
    with pytest.raises(SessionNotFound):
        store.artifacts("no-such-session")
    with pytest.raises(SessionNotFound):
        store.artifacts(session.id, tenant_id="globex")
    assert store.artifacts(session.id, tenant_id="acme").session_id == session.id


@SQLITE_ONLY
@FILE_ONLY  # directories of the filesystem layout
def test_directory_is_created_lazily(store: SessionStore) -> None:
    manager = store.artifacts(store.create_session(tenant_id="acme").id)
    assert not manager.directory().exists()
    manager.save("x", "bash")
    assert manager.directory().is_dir()
    assert manager.directory().parent.name == "acme"


# --- agent outputs ---------------------------------------------------------------------------


def test_agent_output_ids_and_nesting(store: SessionStore, raw: RawArtifacts) -> None:
    manager = store.artifacts(store.create_session(tenant_id="acme").id)
    top = manager.save_agent_output("Explore", "# found things")
    assert top == "0-Explore"
    assert manager.save_agent_output("code review", "ok") == "1-code_review"
    child = manager.save_agent_output("grep", "{}", parent_id=top)
    assert child == "0-Explore.0-grep"
    assert manager.save_agent_output("grep", "{}", parent_id=top) == "0-Explore.1-grep"
    grandchild = manager.save_agent_output("..", "deep", parent_id=child)
    assert grandchild == "0-Explore.0-grep.0-agent"
    assert manager.save_agent_output("next", "z") == "2-next"  # top level unaffected
    directory = manager.directory()
    assert raw.text(directory / "0-Explore.md") == "# found things"
    assert raw.text(directory / "0-Explore.0-grep.0-agent.md") == "deep"


@SQLITE_ONLY
def test_agent_output_jsonl_sidecar(store: SessionStore, raw: RawArtifacts) -> None:
    manager = store.artifacts(store.create_session(tenant_id="acme").id)
    output_id = manager.save_agent_output("task", "result", jsonl='{"a":1}\n{"b":2}\n')
    directory = manager.directory()
    assert raw.text(directory / f"{output_id}.md") == "result"
    assert raw.text(directory / f"{output_id}.jsonl") == '{"a":1}\n{"b":2}\n'
    assert manager.list("agent_output")[0].size_bytes == len("result") + 16
    plain = manager.save_agent_output("task", "only markdown")
    assert not raw.exists(directory / f"{plain}.jsonl")


def test_a_failed_rewrite_keeps_the_previous_agent_output(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, raw: RawArtifacts
) -> None:
    manager = store.artifacts(store.create_session(tenant_id="acme").id)
    output_id = manager.save_agent_output("task", "version 1", jsonl='{"v":1}\n')

    def fail(*args: object, **kwargs: object) -> None:
        raise ConnectionError("database went away mid-write")

    monkeypatch.setattr(rows, "set_size", fail)  # after both files were renamed into place
    with pytest.raises(ConnectionError):
        manager.write_agent_output(output_id, "version 2", jsonl='{"v":2}\n')
    monkeypatch.undo()

    directory = manager.directory()
    assert raw.text(directory / f"{output_id}.md") == "version 1"
    assert raw.text(directory / f"{output_id}.jsonl") == '{"v":1}\n'
    assert store.resolve(f"agent://{output_id}", session_id=manager.session_id).content == (
        "version 1"
    )
    assert raw.keys_under(directory / ".tmp") == []  # nothing left staged
    assert manager.write_agent_output(output_id, "version 3") == len("version 3")
    assert raw.text(directory / f"{output_id}.md") == "version 3"


@SQLITE_ONLY
def test_agent_output_allocate_then_write(store: SessionStore, raw: RawArtifacts) -> None:
    manager = store.artifacts(store.create_session(tenant_id="acme").id)
    slot = manager.allocate_agent_output("worker")
    assert (slot.id, slot.md_path.name, slot.jsonl_path.name) == (
        "0-worker",
        "0-worker.md",
        "0-worker.jsonl",
    )
    assert manager.write_agent_output(slot.id, "v1") == 2
    assert manager.write_agent_output(slot.id, "version 2") == 9
    assert raw.text(slot.md_path) == "version 2"
    with pytest.raises(ArtifactNotFound):
        manager.write_agent_output("7-nobody", "x")


def test_agent_output_parent_must_exist(store: SessionStore) -> None:
    manager = store.artifacts(store.create_session(tenant_id="acme").id)
    for parent in ("0-ghost", "../x", ""):
        with pytest.raises(ArtifactNotFound, match="agent output not found"):
            manager.save_agent_output("child", "x", parent_id=parent)
    assert manager.save_agent_output("first", "x") == "0-first"  # nothing was consumed


@SQLITE_ONLY
def test_agent_output_nesting_depth_is_bounded(store: SessionStore) -> None:
    manager = store.artifacts(store.create_session(tenant_id="acme").id)
    parent = manager.save_agent_output("a" * 64, "x")
    with pytest.raises(ArtifactError, match="too long"):
        for _ in range(5):
            parent = manager.save_agent_output("a" * 64, "x", parent_id=parent)
    assert len(parent) <= 200


# --- counters (a fork continues the parent's numbering) ---------------------------------------


def test_set_counter_floor_continues_numbering(store: SessionStore) -> None:
    parent = store.artifacts(store.create_session(tenant_id="acme").id)
    for _ in range(3):
        parent.save("x", "bash")
    parent.save_agent_output("a", "x")
    child_session = store.create_session(tenant_id="acme")
    with write_transaction(store.engine) as conn:
        for name, value in counter_values(conn, parent.session_id).items():
            set_counter_floor(conn, child_session.id, name, value)
        set_counter_floor(conn, child_session.id, "artifact", 1)  # never lowers
    with read_connection(store.engine) as conn:
        assert counter_values(conn, child_session.id) == {"artifact": 3, agent_counter(None): 1}
    child = store.artifacts(child_session.id)
    assert child.save("y", "bash") == "3"
    assert child.save_agent_output("b", "y") == "1-b"
    assert agent_counter("0-a") == "agent:0-a"
