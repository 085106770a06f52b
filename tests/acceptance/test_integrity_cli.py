"""The real ``sessionstore`` executable: blobs verify, sessions repair, and a one-line error
for usage numbers out of range (issue 16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core import SessionStore, Settings
from core.blobs.files import FileBlobStore
from core.sessions.moves import Moves
from tests.acceptance.test_cli import assert_user_error, run

pytestmark = pytest.mark.slow  # each test runs the CLI in subprocesses

TEXT = b"".join(b"line %d: the quick brown fox\n" % i for i in range(3000))


def _data_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    assert run(folder, "db", "upgrade").returncode == 0
    return folder


def test_blobs_verify_reports_quarantines_and_repairs(tmp_path: Path) -> None:
    data_dir = _data_dir(tmp_path)
    with SessionStore.from_settings(Settings(data_dir=data_dir)) as store:
        blob_hash = store.blobs.put(TEXT).hash
        blobs = store.blobs
        assert isinstance(blobs, FileBlobStore)
        path = blobs.path_for(blob_hash, "gzip")
    good = tmp_path / "good"
    good.mkdir()
    (good / blob_hash).write_bytes(TEXT)
    path.write_bytes(path.read_bytes()[:40])

    found = run(data_dir, "blobs", "verify", "--json")
    assert found.returncode == 1, found.stderr
    report = json.loads(found.stdout)
    assert report["corrupt"] == [blob_hash] and report["quarantined_count"] == 1
    assert not path.exists()

    repaired = run(data_dir, "blobs", "verify", "--repair-from", str(good), "--json")
    assert repaired.returncode == 0, repaired.stderr
    assert json.loads(repaired.stdout)["repaired"] == [blob_hash]
    assert run(data_dir, "blobs", "verify").returncode == 0


def test_sessions_repair_finishes_an_interrupted_move(tmp_path: Path) -> None:
    data_dir = _data_dir(tmp_path)
    with SessionStore.from_settings(Settings(data_dir=data_dir)) as store:
        session = store.create_session(tenant_id="acme")
        store.artifacts(session.id).files.put("a.txt", "kept")
        Moves._record_intent(store._moves, session.id, "globex", None)  # crashed right after

    done = run(data_dir, "sessions", "repair", "--json")
    assert done.returncode == 0, done.stderr
    [repair] = json.loads(done.stdout)["repaired"]
    assert (repair["session_id"], repair["outcome"]) == (session.id, "rolled_back")
    assert json.loads(run(data_dir, "sessions", "repair", "--json").stdout)["repaired"] == []


def test_usage_out_of_range_is_a_one_line_error(tmp_path: Path) -> None:
    data_dir = _data_dir(tmp_path)
    with SessionStore.from_settings(Settings(data_dir=data_dir)) as store:
        session_id = store.create_session(tenant_id="acme").id
    event = {"type": "message", "message": {"role": "assistant", "usage": {"input": 2**64}}}
    result = run(data_dir, "append", session_id, "-", stdin=json.dumps(event) + "\n")
    assert_user_error(result, "/message/usage/input")
    assert len(result.stderr.strip().splitlines()) == 1
    stats = run(data_dir, "stats", "--json")
    assert stats.returncode == 0, stats.stderr
