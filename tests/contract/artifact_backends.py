"""Artifact storage backends for the artifact contract tests: ``file://`` and ``s3://``.

A test module imports ``artifact_backend`` and ``settings`` from here (its ``settings``
then points ``artifact_url`` at a fresh moto bucket for the s3 case) and ``FILE_ONLY`` for
tests about the filesystem layout itself. ``RawArtifacts`` inspects and alters what a
backend stored, by the path the filesystem layout gives it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from core import Settings
from core.artifacts.storage import (
    ArtifactStorage,
    FileArtifactStorage,
    key_of,
    key_prefix_of,
    open_artifact_storage,
)

ARTIFACT_BACKENDS = ["file", "s3"]
FILE_ONLY = pytest.mark.parametrize("artifact_backend", ["file"])


@pytest.fixture(params=ARTIFACT_BACKENDS)
def artifact_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def settings(
    database_url: str, tmp_path: Path, artifact_backend: str, request: pytest.FixtureRequest
) -> Settings:
    base = Settings(data_dir=tmp_path / "data", database_url=database_url)
    if artifact_backend == "s3":
        bucket = str(request.getfixturevalue("s3_bucket"))
        return base.with_overrides(artifact_url=f"{bucket}/artifacts")
    return base


class RawArtifacts:
    """What the backend holds at a path of the filesystem layout (a key on S3)."""

    def __init__(self, settings: Settings) -> None:
        self.root = settings.resolved_artifact_root
        self.storage: ArtifactStorage = open_artifact_storage(settings.resolved_artifact_url)

    @property
    def on_files(self) -> bool:
        return isinstance(self.storage, FileArtifactStorage)

    def exists(self, path: Path) -> bool:
        return self.storage.size(key_of(self.root, path)) is not None

    def read(self, path: Path) -> bytes | None:
        return self.storage.read(key_of(self.root, path))

    def text(self, path: Path) -> str:
        data = self.read(path)
        assert data is not None, f"nothing stored at {path}"
        return data.decode()

    def gone(self, path: Path) -> bool:
        """Nothing at ``path`` (file or directory; on S3: no object, none under it)."""
        if self.on_files:
            return not path.exists()
        is_key = len(path.relative_to(self.root).parts) > 2
        return not self.keys_under(path) and not (is_key and self.exists(path))

    def stored_bytes(self, directory: Path) -> int:
        """Bytes of every file/object under ``directory``."""
        total = 0
        for key in self.keys_under(directory):
            size = self.storage.size(key)
            total += size or 0
        return total

    def delete(self, path: Path) -> None:
        self.storage.delete(key_of(self.root, path))

    def keys_under(self, directory: Path) -> list[str]:
        prefix = key_prefix_of(self.root, directory)
        if self.on_files:
            if not directory.exists():
                return []
            return sorted(
                p.relative_to(self.root).as_posix() for p in directory.rglob("*") if p.is_file()
            )
        import obstore

        from core.artifacts.objects import ObjectArtifactStorage

        assert isinstance(self.storage, ObjectArtifactStorage)
        pages = obstore.list(self.storage.store, prefix=prefix + "/")
        return sorted(str(m["path"]) for page in pages for m in page)


@pytest.fixture
def raw(settings: Settings) -> RawArtifacts:
    return RawArtifacts(settings)
