"""A staged artifact file whose publish fails leaves nothing behind in the staging
directory (a review of the artifact store, stop 39: the backup of the file it was to
replace stayed, a ``.bak`` no sweep removes)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from core import nofollow
from core.artifacts import fsio
from core.artifacts.paths import STAGING_DIR
from core.errors import StorageUnavailable


def test_a_publish_failing_after_its_backup_leaves_the_target_and_no_backup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = tmp_path / "artifacts" / "acme" / "s1"
    session.mkdir(parents=True)
    target = session / "0.bash.log"
    target.write_bytes(b"before")
    staged = fsio.StagedFile(session, b"after")

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(nofollow, "replace", full)
    with pytest.raises(StorageUnavailable):
        staged.publish(session, target)
    monkeypatch.undo()
    staged.discard()
    assert target.read_bytes() == b"before"
    assert list((session / STAGING_DIR).iterdir()) == []


@pytest.mark.parametrize("failing", ["write", "fsync"])
def test_a_staged_write_failing_on_a_full_disk_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """Each failed attempt left its partly written temporary file for the staging sweep
    (hours later): a queue retrying a write on a full disk piled them up (review 4, t11)."""
    session = tmp_path / "artifacts" / "acme" / "s1"
    session.mkdir(parents=True)
    real_write = nofollow.os.write

    def half_then_full(fd: int, data: bytes) -> int:
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    for _attempt in range(3):
        with monkeypatch.context() as patch:
            if failing == "write":
                patch.setattr(nofollow.os, "write", half_then_full)
            else:
                patch.setattr(nofollow.os, "fsync", full)
            with pytest.raises(StorageUnavailable):
                fsio.StagedFile(session, b"x" * 10_000)
    assert list((session / STAGING_DIR).iterdir()) == []
