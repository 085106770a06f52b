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
from tests.support import blobs_in_distinct_fanouts

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


def test_blobs_verify_reports_symlinks_and_goes_on(tmp_path: Path) -> None:
    """Two planted links (at a blob's file, as a blob's fan-out directory) and a corrupt
    blob: all three reported, in the text and in ``--json``; the good blobs are ok; exit 1."""
    data_dir = _data_dir(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    with SessionStore.from_settings(Settings(data_dir=data_dir)) as store:
        blobs = store.blobs
        assert isinstance(blobs, FileBlobStore)
        puts = blobs_in_distinct_fanouts(blobs, [b"blob %d " % i + TEXT for i in range(5)])
        linked_file, linked_dir, corrupt = (blobs.path_for(p.hash, p.codec) for p in puts[:3])
    linked_file.unlink()
    linked_file.symlink_to(outside / "secret")
    fanout = linked_dir.parent
    fanout.rename(outside / "fanout")
    fanout.symlink_to(outside / "fanout")
    corrupt.write_bytes(corrupt.read_bytes()[:40])

    found = run(data_dir, "blobs", "verify", "--json")
    assert found.returncode == 1, found.stderr
    assert "Traceback" not in found.stderr
    report = json.loads(found.stdout)
    assert sorted(report["symlinks"]) == sorted([str(linked_file), str(fanout)])
    assert report["symlinks_count"] == 2 and report["corrupt"] == [puts[2].hash]
    assert (report["checked"], report["ok"], report["healthy"]) == (5, 2, False)

    text = run(data_dir, "blobs", "verify")
    assert text.returncode == 1 and "Traceback" not in text.stderr, text.stderr
    assert f"symlink: {linked_file}" in text.stderr and f"symlink: {fanout}" in text.stderr
    assert f"missing: {puts[2].hash}" in text.stderr  # the first run moved it to corrupt/
    assert list(outside.iterdir()) == [outside / "fanout"]


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
