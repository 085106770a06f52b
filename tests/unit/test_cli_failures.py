"""The CLI's classification of typed failures: exit code, one line, the hint that fits."""

from __future__ import annotations

import pytest

from core.errors import StorageUnavailable
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
