"""An inherited file held for a pending fork, where hard links fail (another filesystem, a
directory moved mid-operation): copied through a temporary file of its own name. A fixed
name (``.NAME.cow``) left behind by a copy cut short made every later copy to that target
fail with FileExistsError, for good; and a temporary file beside the target, left by a
process killed mid-copy, was never removed."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from core import nofollow
from core.artifacts import inherited
from core.artifacts.fsio import sweep_staging
from core.artifacts.paths import STAGING_DIR


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
    assert target.stat().st_mtime_ns == 2_000_000_000  # the times the fork's copy checks
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

    monkeypatch.setattr(nofollow, "replace", killed)
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
