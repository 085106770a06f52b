"""An inherited file held for a pending fork, where hard links fail (another filesystem, a
directory moved mid-operation): copied through a temporary file of its own name. A fixed
name (``.NAME.cow``) left behind by a copy cut short made every later copy to that target
fail with FileExistsError, for good; a temporary file beside the target, left by a
process killed mid-copy, was never removed; and a file made at the target while the copy
was written (the fork's own) was replaced by it."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from core import nofollow
from core.artifacts import inherited, integrity
from core.artifacts.fsio import sweep_staging
from core.artifacts.paths import STAGING_DIR
from core.artifacts.records import ArtifactInfo
from core.sessions import fork_copy


@pytest.fixture
def no_hard_links(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(root: Path, source: Path, target: Path) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(nofollow, "link", refuse)


def _files(tmp_path: Path) -> tuple[Path, Path, Path]:
    root = tmp_path / "artifacts"
    session = root / "acme" / "s"
    source, target = session / "plan.md", session / "held" / "plan.md"
    target.parent.mkdir(parents=True)
    source.write_bytes(b"the parent's version")
    os.utime(source, ns=(1_000_000_000, 2_000_000_000))
    return root, source, target


@pytest.mark.usefixtures("no_hard_links")
def test_a_leftover_temporary_file_never_blocks_the_copy(tmp_path: Path) -> None:
    root, source, target = _files(tmp_path)
    (target.parent / ".plan.md.cow").write_bytes(b"left by a copy cut short")
    assert inherited._link_new(root, source, target) is True
    assert target.read_bytes() == b"the parent's version"
    assert target.stat().st_mtime_ns == 2_000_000_000  # the times a link would keep
    assert sorted(p.name for p in target.parent.iterdir()) == [".plan.md.cow", "plan.md"]


@pytest.mark.usefixtures("no_hard_links")
def test_a_copy_cut_short_leaves_its_file_where_the_sweep_removes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed between writing the copy and renaming it into place leaves the
    copy in the session's staging directory: the expiry sweep removes it."""
    root, source, target = _files(tmp_path)

    def killed(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(nofollow, "rename_new", killed)
    monkeypatch.setattr(nofollow, "unlink", lambda *args, **kwargs: None)  # no clean-up ran
    with pytest.raises(KeyboardInterrupt):
        inherited._link_new(root, source, target)
    staging = root / "acme" / "s" / STAGING_DIR
    (left,) = staging.iterdir()
    assert left.read_bytes() == b"the parent's version"
    assert not target.exists() and sorted(p.name for p in target.parent.iterdir()) == []
    monkeypatch.undo()  # the sweep's own unlink
    assert sweep_staging(root, older_than_s=0, apply=True, now=left.stat().st_ctime + 1) == (
        1,
        len(b"the parent's version"),
    )
    assert list(staging.iterdir()) == []


@pytest.mark.usefixtures("no_hard_links")
@pytest.mark.parametrize("noreplace", [True, False], ids=["renameat2", "check-then-rename"])
def test_a_file_made_at_the_target_meanwhile_is_never_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, noreplace: bool
) -> None:
    """The fork writes its own file between the copy's check for one and its rename: the
    fork's file stays, the copy is dropped (no leftover in staging), and the link is not
    counted as made."""
    root, source, target = _files(tmp_path)
    if not noreplace:  # a filesystem without RENAME_NOREPLACE: the check before the rename
        monkeypatch.setattr(nofollow, "_renameat2", None)
    write_new = nofollow.write_new

    def then_the_fork_writes(root_: Path, path: Path, data: bytes) -> None:
        write_new(root_, path, data)
        target.write_bytes(b"the fork's own version")

    monkeypatch.setattr(nofollow, "write_new", then_the_fork_writes)
    assert inherited._link_new(root, source, target) is False
    assert target.read_bytes() == b"the fork's own version"
    assert list((root / "acme" / "s" / STAGING_DIR).iterdir()) == []


@pytest.mark.parametrize("noreplace", [True, False], ids=["renameat2", "check-then-rename"])
def test_rename_new(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, noreplace: bool) -> None:
    if not noreplace:
        monkeypatch.setattr(nofollow, "_renameat2", None)
    (tmp_path / "a").write_bytes(b"a")
    (tmp_path / "taken").write_bytes(b"taken")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    for name in ("taken", "link"):  # a dangling link is a name taken too, never followed
        with pytest.raises(FileExistsError):
            nofollow.rename_new(tmp_path, tmp_path / "a", tmp_path / name)
    assert not (tmp_path / "nowhere").exists()
    nofollow.rename_new(tmp_path, tmp_path / "a", tmp_path / "sub" / "b")
    assert (tmp_path / "sub" / "b").read_bytes() == b"a" and not (tmp_path / "a").exists()
    assert (tmp_path / "taken").read_bytes() == b"taken"


@pytest.mark.parametrize("noreplace", [True, False], ids=["renameat2", "check-then-rename"])
def test_the_fork_copy_never_replaces_a_file_made_just_before_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, noreplace: bool
) -> None:
    """The fork's copy job, where hard links fail: a file made at the target after the
    copy's checks (the fork's own write, just before the rename) stays."""
    root, source, target = _files(tmp_path)
    monkeypatch.setattr(nofollow, "link", _refuse_link(errno.EPERM))
    if not noreplace:
        monkeypatch.setattr(nofollow, "_renameat2", None)
    parent_dir = nofollow.parent_dir

    def the_fork_writes_first(root_: Path, path: Path, **kwargs: Any) -> Any:
        if path == target and kwargs.get("create"):
            target.write_bytes(b"the fork's own version")
        return parent_dir(root_, path, **kwargs)

    monkeypatch.setattr(nofollow, "parent_dir", the_fork_writes_first)
    staging = root / "acme" / "s" / STAGING_DIR
    row = ArtifactInfo(
        session_id="s",
        kind="file",
        local_id="plan.md",
        name="plan.md",
        tool_type=None,
        size_bytes=len(b"the parent's version"),
        media_type=None,
        created_at=datetime.now(UTC),
        created_seq=0,
        sha256=integrity.digest(b"the parent's version"),
    )
    assert fork_copy._copy_file(source, target, staging, row, root) is None
    assert target.read_bytes() == b"the fork's own version"
    assert list(staging.iterdir()) == []


def _refuse_link(code: int) -> Callable[[Path, Path, Path], None]:
    def refuse(root: Path, source: Path, target: Path) -> None:
        raise OSError(code, os.strerror(code))

    return refuse
