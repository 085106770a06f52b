"""What every artifact operation on one session needs: engine, settings, root, session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine

from core.artifacts import rows
from core.artifacts.paths import session_dir
from core.artifacts.storage import ArtifactStorage, FileArtifactStorage, artifact_storage_for
from core.db import read_connection
from core.settings import Settings


@dataclass(frozen=True, slots=True)
class SessionScope:
    engine: Engine
    settings: Settings
    root: Path
    session_id: str
    # None: the filesystem at ``root`` (today's code paths); else the object store, whose
    # keys are the paths below ``root``.
    objects: ArtifactStorage | None = None

    @classmethod
    def create(cls, engine: Engine, settings: Settings, session_id: str) -> SessionScope:
        storage = artifact_storage_for(settings)
        objects = None if isinstance(storage, FileArtifactStorage) else storage
        return cls(engine, settings, settings.resolved_artifact_root, session_id, objects)

    def storage(self) -> ArtifactStorage:
        return self.objects if self.objects is not None else FileArtifactStorage(self.root)

    def dir_for(self, tenant_id: str) -> Path:
        return session_dir(self.root, tenant_id, self.session_id)

    def info(self, *, tenant_id: str | None = None) -> rows.SessionQuotaRow:
        """The session's current tenant and head (raises SessionNotFound)."""
        with read_connection(self.engine) as conn:
            return rows.session_info(conn, self.session_id, tenant_id=tenant_id)

    def directory(self) -> Path:
        """The session's artifact directory under its current tenant (may not exist yet)."""
        return self.dir_for(self.info().tenant_id)
