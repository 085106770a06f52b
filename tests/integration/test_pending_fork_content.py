"""Issue 16, item 7: a pending fork keeps its fork-point content through any rewrite,
delete or move of the parent (copy-on-write of the parent's old content). Both backends."""

from __future__ import annotations

import pytest

from core import SessionStore
from core.artifacts import session_dir
from tests.contract.test_fork import defer_copies

FILES = {"a.txt": b"alpha at the fork", "dir/b.md": b"# bee", "c.bin": b"\x00\x01\x02"}


def _fork_point(store: SessionStore) -> tuple[str, str]:
    parent = store.create_session(tenant_id="acme")
    store.append(parent.id, [{"type": "custom", "n": 1}])
    for path, data in FILES.items():
        store.artifacts(parent.id).files.put(path, data)
    defer_copies(store)
    fork = store.fork(parent.id)
    assert store.get_session(fork.id).copy_status == "pending"
    return parent.id, fork.id


def _fork_files(store: SessionStore, fork_id: str) -> dict[str, bytes]:
    files = store.artifacts(fork_id).files
    return {info.local_id: files.get(info.local_id) for info in files.list()}


@pytest.mark.parametrize("then", ["read", "copy", "move_parent", "delete_parent"])
def test_fork_keeps_fork_point_files_through_parent_rewrite_and_delete(
    store: SessionStore, then: str
) -> None:
    parent_id, fork_id = _fork_point(store)
    parent = store.artifacts(parent_id).files
    parent.put("a.txt", b"ALPHA REWRITTEN AT THE SAME SIZE"[: len(FILES["a.txt"])])
    parent.put("dir/b.md", b"# a longer rewrite of bee")
    parent.delete("c.bin")
    parent.put("new.txt", b"after the fork")

    if then == "copy":
        report = store.copy_fork_artifacts(fork_id)
        assert report.error is None and store.get_session(fork_id).copy_status == "copied"
    elif then == "move_parent":
        store.move(parent_id, tenant_id="globex")  # finishes the fork's copy first
    elif then == "delete_parent":
        store.delete_session(parent_id)

    assert _fork_files(store, fork_id) == FILES
    if then == "read":
        store.copy_fork_artifacts(fork_id)
        assert _fork_files(store, fork_id) == FILES


def test_a_rewrite_after_the_fork_copy_is_not_pushed_into_the_fork(store: SessionStore) -> None:
    parent_id, fork_id = _fork_point(store)
    store.copy_fork_artifacts(fork_id)
    store.artifacts(parent_id).files.put("a.txt", b"later")
    assert _fork_files(store, fork_id) == FILES
    assert store.artifacts(parent_id).files.get("a.txt") == b"later"


def _outputs_at_fork_point(store: SessionStore) -> tuple[str, str, dict[str, str]]:
    """A parent with an allocated agent output (with its JSONL sidecar), an imported agent
    output and an imported tool output; then a fork whose copy stays pending."""
    parent = store.create_session(tenant_id="acme")
    store.append(parent.id, [{"type": "custom", "n": 1}])
    manager = store.artifacts(parent.id)
    slot = manager.allocate_agent_output("explorer")
    manager.write_agent_output(slot.id, "# findings at the fork", jsonl='{"step": 1}\n')
    manager.put_agent_output("ext.reviewer", "review at the fork", jsonl='{"ok": true}\n')
    manager.put_tool_output("7", "bash", "tool log at the fork")
    defer_copies(store)
    fork = store.fork(parent.id)
    assert store.get_session(fork.id).copy_status == "pending"
    urls = {
        f"agent://{slot.id}": "# findings at the fork",
        "agent://ext.reviewer": "review at the fork",
        "artifact://7": "tool log at the fork",
    }
    return parent.id, fork.id, urls


def _dir_files(store: SessionStore, session_id: str) -> dict[str, bytes]:
    session = store.get_session(session_id)
    directory = session_dir(store.settings.resolved_artifact_root, session.tenant_id, session_id)
    return {
        p.name: p.read_bytes()
        for p in directory.iterdir()
        if p.is_file() and p.suffix in (".md", ".jsonl", ".log")
    }


@pytest.mark.parametrize("then", ["read", "copy", "move_parent", "delete_parent"])
def test_fork_keeps_fork_point_agent_and_tool_outputs_through_parent_rewrites(
    store: SessionStore, then: str
) -> None:
    """Issue 16, item 7, for every rewritable kind: an agent output rewritten in place
    (``write_agent_output``), agent and tool outputs replaced under their ids (``put_*``,
    as a re-import does). The fork keeps the bytes of every file, sidecars included."""
    parent_id, fork_id, urls = _outputs_at_fork_point(store)
    at_fork = _dir_files(store, parent_id)
    assert len(at_fork) == 5  # 2 markdown files, 2 sidecars, 1 tool log
    manager = store.artifacts(parent_id)
    explorer = next(u for u in urls if u.startswith("agent://") and "ext." not in u)
    manager.write_agent_output(explorer[len("agent://") :], "# REWRITTEN", jsonl="{}\n")
    manager.put_agent_output("ext.reviewer", "REPLACED", jsonl="[]\n")
    manager.put_tool_output("7", "bash", "REPLACED LOG")
    assert store.resolve("artifact://7", session_id=parent_id).content == "REPLACED LOG"

    for url, content in urls.items():  # the pending fork reads what it inherited
        assert store.resolve(url, session_id=fork_id).content == content, url

    if then == "copy":
        report = store.copy_fork_artifacts(fork_id)
        assert report.error is None and store.get_session(fork_id).copy_status == "copied"
    elif then == "move_parent":
        store.move(parent_id, tenant_id="globex")  # finishes the fork's copy first
    elif then == "delete_parent":
        store.delete_session(parent_id)
    else:
        store.copy_fork_artifacts(fork_id)

    assert _dir_files(store, fork_id) == at_fork
    for url, content in urls.items():
        assert store.resolve(url, session_id=fork_id).content == content, url
