"""A new directory is durable only once its parent is synced: every writer that needed it
syncs that parent, also the one that lost the race to make it (the winner may die before
its own sync, and the loser's file would go with the directory entry)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from core import fsio, nofollow


def _synced_dirs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def test_the_writer_that_lost_the_mkdir_race_syncs_the_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "blobs"
    root.mkdir()
    real_mkdir = os.mkdir

    def another_writer_wins(name: str, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        real_mkdir(name, mode, dir_fd=dir_fd)  # the other writer makes it first...
        raise FileExistsError(name)  # ...so this one's mkdir fails

    monkeypatch.setattr(os, "mkdir", another_writer_wins)
    synced = _synced_dirs(monkeypatch)
    fsio.replace_many_atomically([(root / "ab" / "cd" / "f", b"data")], root=root)
    assert (root / "ab" / "cd" / "f").read_bytes() == b"data"
    # the parents of both new directories were synced, not only the file's directory
    assert {str(root), str(root / "ab")} <= set(synced), synced


def test_a_directory_that_existed_costs_no_parent_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "blobs"
    (root / "ab" / "cd").mkdir(parents=True)
    synced = _synced_dirs(monkeypatch)
    made: set[tuple[str, ...]] = set()
    with nofollow.DirTree(root, create=True, made=made) as tree:
        tree.parent_of(root / "ab" / "cd" / "f")
    assert made == set()
    fsio.replace_many_atomically([(root / "ab" / "cd" / "g", b"data")], root=root)
    # the rename itself was made durable (the directory it is in was synced: the spy saw
    # it), and no parent of a directory that already existed was
    assert str(root / "ab" / "cd") in synced, synced
    assert str(root) not in synced and str(root / "ab") not in synced
