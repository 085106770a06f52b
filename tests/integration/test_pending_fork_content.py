"""Issue 16, item 7: a pending fork keeps its fork-point content through any rewrite,
delete or move of the parent (copy-on-write of the parent's old content). Both backends."""

from __future__ import annotations

import pytest

from core import SessionStore
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
