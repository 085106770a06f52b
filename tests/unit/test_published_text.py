"""Where ``core.fsio.published_text`` (``export -o PATH``) writes: a new file renamed over a
regular file, but in place into what is no file to replace. It renamed over whatever was at
PATH: a FIFO's reader got nothing, a link was replaced by a file, and ``-o /dev/stdout``
(run as root) replaced the system's /dev/stdout with a regular file."""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from core.errors import UnwritableFile
from core.fsio import published_text


def _publish(path: Path, text: str) -> None:
    with published_text(path) as out:
        out.write(text)


def test_a_regular_file_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    _publish(path, "new\n")
    assert path.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "out.jsonl"
    ]


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o604, 0o755])
def test_a_replaced_file_keeps_its_permissions(tmp_path: Path, mode: int) -> None:
    """As a shell's ``>`` keeps them: a private file the export replaces stays private
    (a review's finding: ``export -o`` made a 0600 file 0644, readable by every user)."""
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    path.chmod(mode)
    _publish(path, "new\n")
    assert path.read_text() == "new\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == mode


@pytest.mark.parametrize("refusal", ["owner unmappable", "mode refused once given away"])
def test_a_file_of_another_owner_is_replaced_even_where_its_owner_cannot_be_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    """Keeping the replaced file's owner is a courtesy, never a reason to fail the export
    (a review's finding): in a user namespace its owner may not map (``fchown``: EINVAL);
    root without CAP_FOWNER may give the file away and then not set its mode (EPERM). The
    mode is set before the owner."""
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    path.chmod(0o600)
    given_away = []

    def fchown(fd: int, uid: int, gid: int) -> None:
        if refusal == "owner unmappable":
            raise OSError(errno.EINVAL, "Invalid argument")
        given_away.append(fd)

    def fchmod(fd: int, mode: int, real: Any = os.fchmod) -> None:
        if given_away:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        real(fd, mode)

    monkeypatch.setattr(os, "geteuid", lambda: os.stat(path).st_uid + 1)  # another's file
    monkeypatch.setattr(os, "fchown", fchown)
    monkeypatch.setattr(os, "fchmod", fchmod)
    _publish(path, "new\n")
    assert path.read_text() == "new\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert bool(given_away) == (refusal != "owner unmappable")


def test_a_new_file_has_the_umasks_permissions(tmp_path: Path) -> None:
    mask = os.umask(0o027)
    try:
        _publish(tmp_path / "new.jsonl", "new\n")
    finally:
        os.umask(mask)
    assert stat.S_IMODE(os.stat(tmp_path / "new.jsonl").st_mode) == 0o640


def test_a_fifo_is_written_into_and_stays_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    _publish(fifo, "line 1\nline 2\n")
    reader.join(10)
    assert got == [b"line 1\nline 2\n"] and stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_link_to_a_process_descriptor_reaches_it(tmp_path: Path) -> None:
    """``-o /dev/stdout`` is a link to /proc/self/fd/1: the text goes to that descriptor
    (here a pipe's), and the link stays a link."""
    read_end, write_end = os.pipe()
    link = tmp_path / "stdout"
    link.symlink_to(f"/proc/self/fd/{write_end}")
    try:
        _publish(link, "to the pipe\n")
    finally:
        os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        assert pipe.read() == b"to the pipe\n"
    assert link.is_symlink()


def test_a_link_to_a_file_is_written_through_and_stays(tmp_path: Path) -> None:
    target = tmp_path / "real.jsonl"
    target.write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    _publish(link, "new\n")
    assert link.is_symlink() and target.read_text() == "new\n"
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "made.jsonl")
    _publish(dangling, "made\n")
    assert dangling.is_symlink() and (tmp_path / "made.jsonl").read_text() == "made\n"


def test_a_descriptor_open_on_a_shared_file_is_written_through(tmp_path: Path) -> None:
    """``-o /dev/stdout >> log``: the link names a descriptor open on a regular file, which
    other writes share. Resolved by name, the export was renamed over the file, and what
    the log held before (and what came after, into the old file) was lost."""
    log = tmp_path / "log.txt"
    log.write_text("an earlier line\n")
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    link = tmp_path / "stdout"
    link.symlink_to(f"/proc/self/fd/{fd}")
    try:
        _publish(link, "the export\n")
        os.write(fd, b"a later line\n")
    finally:
        os.close(fd)
    assert log.read_text() == "an earlier line\nthe export\na later line\n"


def test_a_path_that_cannot_be_written_is_named_as_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``UnwritableFile`` naming the path the caller gave: the OSError named the temporary
    file beside it (``.out.jsonl.4fs182_0.partial``), which the user never asked for. What
    the caller's own code raises inside the block is left as it is."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnwritableFile) as raised:
        _publish(Path("missing_dir/out.jsonl"), "x\n")
    assert raised.value.message == "cannot write missing_dir/out.jsonl: No such file or directory"
    (tmp_path / "dir").mkdir()
    with pytest.raises(OSError, match="the caller's"), published_text(Path("dir/out")):
        raise OSError("the caller's")
    assert list((tmp_path / "dir").iterdir()) == []
