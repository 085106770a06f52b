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
