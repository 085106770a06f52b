"""An inherited file held for a pending fork, where hard links fail (another filesystem, a
directory moved mid-operation): copied through a temporary file of its own name. A fixed
name (``.NAME.cow``) left behind by a copy cut short made every later copy to that target
fail with FileExistsError, for good."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from core import nofollow
from core.artifacts import inherited


def test_a_leftover_temporary_file_never_blocks_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "artifacts"
    (root / "s").mkdir(parents=True)
    source, target = root / "s" / "plan.md", root / "s" / "held" / "plan.md"
    target.parent.mkdir()
    source.write_bytes(b"the parent's version")
    os.utime(source, ns=(1_000_000_000, 2_000_000_000))
    (target.parent / ".plan.md.cow").write_bytes(b"left by a copy cut short")

    def no_hard_links(root: Path, source: Path, target: Path) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(nofollow, "link", no_hard_links)
    assert inherited._link_new(root, source, target) is True
    assert target.read_bytes() == b"the parent's version"
    assert target.stat().st_mtime_ns == 2_000_000_000  # the times the fork's copy checks
    assert sorted(p.name for p in target.parent.iterdir()) == [".plan.md.cow", "plan.md"]
