"""A FIFO planted where an artifact or blob file belongs is no file: every reader returns
at once, as for a missing or non-regular file, instead of blocking in ``open()`` until some
writer turns up (a worker, the CLI, hung for good).

Each read runs in a thread with a deadline: a regression fails the test (the hung reader is
released by opening the FIFO for writing) instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from core import SessionStore, Settings
from core.artifacts import session_dir
from core.blobs.files import FileBlobStore
from core.blobs.store import SUFFIXES
from core.blobs.verify import verify_blobs
from core.errors import BlobNotFound, ResolveNotFound
from tests.cli_process import run_cli
from tests.support import clean_env, outcome_within

DEADLINE_S = 10.0
TEXT = b"".join(b"line %d: the quick brown fox\n" % i for i in range(3000))


def _plant_fifo(path: Path) -> None:
    if path.exists():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)


def test_a_fifo_at_an_artifact_file_reads_as_no_file(store: SessionStore) -> None:
    session = store.create_session(tenant_id="acme")
    artifacts = store.artifacts(session.id)
    tool_id = artifacts.save("tool output\n", "bash")
    art = store.store_oversized(session.id, "x" * 20_000, "bash")
    assert art is not None
    directory = session_dir(store.settings.resolved_artifact_root, "acme", session.id)
    log_file = directory / f"{tool_id}.bash.log"
    oversized = next((directory / "oversized").iterdir())
    _plant_fifo(log_file)
    _plant_fifo(oversized)

    kind, value = outcome_within(
        lambda: store.resolve(f"artifact://{tool_id}", session_id=session.id), log_file
    )
    assert kind == "raised" and isinstance(value, ResolveNotFound), value
    kind, value = outcome_within(lambda: artifacts.retrieve(art.ref.artifact_id), oversized)
    assert (kind, value) == ("returned", None)


def test_a_fifo_at_a_blob_file_reads_as_no_file(store: SessionStore) -> None:
    """``get`` finds no blob there; ``blobs verify`` reports it missing."""
    blobs = store.blobs
    assert isinstance(blobs, FileBlobStore)
    put = blobs.put(TEXT)
    path = blobs.path_for(put.hash, put.codec)
    _plant_fifo(path)

    kind, value = outcome_within(lambda: blobs.get(put.hash), path)
    assert kind == "raised" and isinstance(value, BlobNotFound), value

    kind, report = outcome_within(lambda: verify_blobs(blobs), path)
    assert kind == "returned" and report.missing == [put.hash], report


def test_blobs_verify_quarantines_a_corrupt_blob_beside_a_fifo(store: SessionStore) -> None:
    """A corrupt file under one codec and a FIFO under the other: the check under the row's
    lock reads each codec's file; the FIFO is no file, the corrupt one is moved aside."""
    blobs = store.blobs
    assert isinstance(blobs, FileBlobStore)
    put = blobs.put(TEXT)
    stored = blobs.path_for(put.hash, put.codec)
    stored.write_bytes(stored.read_bytes()[:40])
    other = next(codec for codec in SUFFIXES if codec != put.codec)
    fifo = blobs.path_for(put.hash, other)
    _plant_fifo(fifo)

    kind, report = outcome_within(lambda: verify_blobs(blobs), fifo)
    assert kind == "returned", report
    assert report.corrupt == [put.hash] and report.counts["quarantined"] == 1
    assert not stored.exists() and fifo.exists()


def test_a_repair_source_holding_a_fifo_is_no_good_copy(
    store: SessionStore, tmp_path: Path
) -> None:
    """``blobs verify --repair-from DIR``: a FIFO named by the hash there is no copy."""
    blobs = store.blobs
    assert isinstance(blobs, FileBlobStore)
    put = blobs.put(TEXT)
    blobs.path_for(put.hash, put.codec).unlink()
    good = tmp_path / "good"
    _plant_fifo(good / put.hash)

    kind, report = outcome_within(lambda: verify_blobs(blobs, repair_from=good), good / put.hash)
    assert kind == "returned", report
    assert (report.missing, report.repaired) == ([put.hash], [])


def test_an_omp_reimport_rewrites_an_artifact_a_fifo_replaced(
    store: SessionStore, tmp_path: Path
) -> None:
    """The re-import compares the stored artifact with the file's: a FIFO there differs,
    and the artifact is written again."""
    from tests.integration.test_omp_import import AGENT, STEM, TENANT

    shutil.copytree(AGENT, tmp_path / "agent")
    layout = tmp_path / "agent" / "sessions" / "--home-dev-webapp--" / f"{STEM}.jsonl"
    first = store.import_session(layout, tenant_id=TENANT)
    log_file = store.artifacts(first.session_id).directory() / "0.bash.log"
    content = log_file.read_bytes()
    _plant_fifo(log_file)

    kind, value = outcome_within(lambda: store.import_session(layout, tenant_id=TENANT), log_file)
    assert kind == "returned", value
    assert log_file.is_file() and log_file.read_bytes() == content


@pytest.mark.slow
def test_the_cli_never_hangs_on_a_fifo(tmp_path: Path) -> None:
    """``sessionstore read`` and ``sessionstore blobs verify`` in a subprocess, each with a
    deadline: a FIFO at the artifact is no artifact; beside a corrupt blob it is no file."""
    data_dir = tmp_path / "data"
    with SessionStore.from_settings(Settings(data_dir=data_dir)) as store:
        session = store.create_session(tenant_id="acme")
        tool_id = store.artifacts(session.id).save("tool output\n", "bash")
        put = store.blobs.put(TEXT)
        blobs = store.blobs
        assert isinstance(blobs, FileBlobStore)
        stored = blobs.path_for(put.hash, put.codec)
        other = next(codec for codec in SUFFIXES if codec != put.codec)
        fifo = blobs.path_for(put.hash, other)
        root = store.settings.resolved_artifact_root
    log_file = session_dir(root, "acme", session.id) / f"{tool_id}.bash.log"
    _plant_fifo(log_file)
    stored.write_bytes(stored.read_bytes()[:40])
    _plant_fifo(fifo)

    read = _cli(data_dir, "read", f"artifact://{tool_id}", "--session", session.id)
    assert read.returncode == 4 and "Traceback" not in read.stderr, read.stderr  # no such artifact
    verify = _cli(data_dir, "blobs", "verify", "--json")
    assert verify.returncode == 1, verify.stderr
    assert json.loads(verify.stdout)["corrupt"] == [put.hash]


def _cli(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = clean_env(data_dir)
    try:
        return run_cli(*args, env=env, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`sessionstore {' '.join(args)}` blocked on a FIFO")
