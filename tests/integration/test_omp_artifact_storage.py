"""oh-my-pi's layout against each artifact backend (``file://`` and ``s3://`` on moto), and
what the importer and exporter read from places a hostile user can plant things in: a FIFO
named as a blob in the source ``blobs`` directory, a link at an exported sidecar."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from core import SessionStore
from core.artifacts.paths import session_dir
from core.errors import SymlinkRefused
from core.interop.omp import export_omp
from tests.contract.artifact_backends import FILE_ONLY, artifact_backend, settings
from tests.integration.test_omp_import import ARTIFACTS, MISSING_REF, SESSION_FILE, STEM
from tests.support import outcome_within

__all__ = ["artifact_backend", "settings"]

TENANT = "acme"


def test_export_carries_every_artifact_and_sidecar_on_each_backend(
    store: SessionStore, tmp_path: Path
) -> None:
    """On S3 the export wrote no artifact at all: it read them, and the agent output's
    sidecar, as local files below the artifact root."""
    result = store.import_session(SESSION_FILE, tenant_id=TENANT)
    out = export_omp(store, result.session_id, tmp_path / "sessions", blobs_dir=tmp_path / "b")
    exported = {p.name: p.read_bytes() for p in out.artifacts_dir.iterdir()}
    original = {p.name: p.read_bytes() for p in ARTIFACTS.iterdir() if not p.name.startswith(".")}
    assert exported == original
    assert any(name.endswith(".jsonl") for name in exported)  # the sidecar is among them


@FILE_ONLY
def test_export_never_reads_a_sidecar_through_a_link(store: SessionStore, tmp_path: Path) -> None:
    """A link planted at an agent output's sidecar, to a file outside the data root: the
    export refuses it instead of copying the outside file into the export."""
    (tmp_path / "secret.txt").write_text("SECRET")
    result = store.import_session(SESSION_FILE, tenant_id=TENANT)
    assert result.session_id is not None
    own = session_dir(store.settings.resolved_artifact_root, TENANT, result.session_id)
    [sidecar] = [p for p in own.iterdir() if p.name.endswith(".jsonl")]
    sidecar.unlink()
    os.symlink(tmp_path / "secret.txt", sidecar)
    with pytest.raises(SymlinkRefused):
        export_omp(store, result.session_id, tmp_path / "out", blobs_dir=tmp_path / "b")
    assert not any(
        p.read_bytes() == b"SECRET" for p in (tmp_path / "out").rglob("*") if p.is_file()
    )


@FILE_ONLY
def test_a_fifo_named_as_a_blob_is_a_missing_blob_not_a_hang(
    store: SessionStore, tmp_path: Path
) -> None:
    agent = tmp_path / "agent"
    shutil.copytree(SESSION_FILE.parents[2], agent)
    os.mkfifo(agent / "blobs" / MISSING_REF.removeprefix("blob:sha256:"))
    layout = agent / "sessions" / SESSION_FILE.parent.name / f"{STEM}.jsonl"
    fifo = agent / "blobs" / MISSING_REF.removeprefix("blob:sha256:")
    kind, result = outcome_within(
        lambda: store.import_session(layout, tenant_id=TENANT), fifo, deadline_s=30
    )
    assert kind == "returned", result
    assert MISSING_REF in result.missing_blobs  # type: ignore[attr-defined]
