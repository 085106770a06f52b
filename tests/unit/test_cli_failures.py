"""The CLI's classification of typed failures: exit code, one line, the hint that fits."""

from __future__ import annotations

import os

import pytest

from core.errors import (
    ImportInterrupted,
    InvalidEvent,
    SessionMoving,
    StorageUnavailable,
    UnwritableFile,
)
from tasks.cli.failures import ExitCode, classify


@pytest.mark.parametrize(
    ("component", "code", "name", "setting"),
    [
        ("database", ExitCode.STORAGE_UNAVAILABLE, "database", "SESSIONSTORE_DATABASE_URL"),
        ("blobs", ExitCode.STORAGE_UNAVAILABLE, "blob store", "SESSIONSTORE_BLOB_URL"),
        ("artifacts", ExitCode.STORAGE_UNAVAILABLE, "artifact store", "SESSIONSTORE_ARTIFACT_URL"),
        ("broker", ExitCode.BROKER_UNAVAILABLE, "broker", "SESSIONSTORE_BROKER_URL"),
    ],
)
def test_unavailable_storage_names_itself_and_its_setting(
    component: str, code: ExitCode, name: str, setting: str
) -> None:
    error = StorageUnavailable(component, f"{component} is unavailable: [Errno 28] No space")
    classified = classify(error)
    assert classified is not None
    assert classified[0] == code
    assert classified[1].startswith(f"{name} unavailable: [Errno 28] No space (check {setting}")
    others = {"SESSIONSTORE_DATABASE_URL", "SESSIONSTORE_BLOB_URL", "SESSIONSTORE_BROKER_URL"}
    assert not any(other in classified[1] for other in others - {setting})


def test_a_pending_move_is_not_an_unavailable_artifact_store() -> None:
    """``SessionMoving`` is a ``StorageUnavailable`` of the artifacts: it was shown as
    "artifact store unavailable (check SESSIONSTORE_ARTIFACT_URL ...)". Still exit 6
    (transient), its own message: the session, and what completes the move."""
    classified = classify(SessionMoving("ses-1"))
    assert classified is not None
    code, line = classified
    assert code == ExitCode.STORAGE_UNAVAILABLE
    assert line.startswith("session ses-1 is being moved: ")
    assert "the reconciler" in line and "`sessionstore sessions repair ses-1`" in line
    assert "artifact store" not in line and "SESSIONSTORE_ARTIFACT_URL" not in line


@pytest.mark.parametrize(
    ("cause", "code", "said"),
    [
        (
            StorageUnavailable("database", "database is unavailable: refused"),
            6,
            "database unavailable: refused (check SESSIONSTORE_DATABASE_URL",
        ),
        (SessionMoving("ses-1"), 6, "session ses-1 is being moved"),
        (InvalidEvent("type", "missing"), 3, "invalid event at type: missing"),
        (RuntimeError("a defect"), 1, "a defect"),
    ],
)
def test_an_interrupted_import_exits_as_what_interrupted_it(
    cause: Exception, code: int, said: str
) -> None:
    error = ImportInterrupted(
        "f.jsonl", session_id="s", external_id="e", appended=2, skipped=0, cause=cause
    )
    classified = classify(error)
    assert classified is not None and classified[0] == code
    assert classified[1].startswith(f"f.jsonl: {said}") and "kept the 2 event(s)" in classified[1]


def test_an_unwritable_file_is_bad_input() -> None:
    assert classify(UnwritableFile("out/x.jsonl", "No such file or directory")) == (
        ExitCode.BAD_INPUT,
        "cannot write out/x.jsonl: No such file or directory",
    )


def test_a_broken_pipe_that_is_not_the_output_is_a_failure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Only a stdout or stderr whose reader is gone is the silent exit 141: a broken pipe
    elsewhere (a socket a driver did not translate) is reported, never silenced (typer ended
    the run with a silent exit 1 on any EPIPE)."""
    from tasks.cli import _closed_pipe

    with pytest.raises(SystemExit) as raised:
        _closed_pipe(BrokenPipeError(32, "Broken pipe"), [])
    assert raised.value.code == ExitCode.BAD_INPUT
    assert capsys.readouterr().err == "error: Broken pipe\n"


def test_an_os_error_is_said_as_a_person_reads_it() -> None:
    """The path, then why: never Python's "[Errno N] ...: '<repr>'"."""
    from tasks.cli.failures import os_error_text

    assert os_error_text(FileNotFoundError(2, "No such file or directory", "a b.jsonl")) == (
        "a b.jsonl: No such file or directory"
    )
    moved = OSError(18, "Invalid cross-device link", "/a", None, "/b")
    assert os_error_text(moved) == "/a -> /b: Invalid cross-device link"
    assert os_error_text(OSError(5, "Input/output error", b"x\xff")) == (
        "x\udcff: Input/output error"
    )
    assert os_error_text(OSError(28, "No space left on device")) == "No space left on device"
    assert os_error_text(OSError("bare")) == "bare"
    assert os_error_text(OSError(9, "Bad file descriptor", 999)) == "fd 999: Bad file descriptor"
    try:
        os.stat(999_999)
    except OSError as exc:  # as Python raises it: the descriptor is the filename
        assert os_error_text(exc) == "fd 999999: Bad file descriptor"
