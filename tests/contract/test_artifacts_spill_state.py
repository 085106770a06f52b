"""A streamed tool output (``allocate_path``, the ``OutputSink`` spill) is ``writing`` until
finalized: a writer killed mid-write leaves a row that says so. Its bytes are never served,
listed, copied or exported as the whole output, and expiry settles what it left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from core import SessionStore, Settings
from core.artifacts import ArtifactManager, OutputSink
from core.artifacts.paths import session_dir
from core.artifacts.storage import key_of
from core.errors import ArtifactIncomplete, ResolveNotFound
from core.interop.omp import export_omp
from core.maintenance.expiry import expire_artifacts
from core.models import ArtifactRow, utcnow
from tests.cli_process import run_cli
from tests.contract.artifact_backends import (  # the file:// and s3:// backends
    FILE_ONLY,
    RawArtifacts,
    artifact_backend,
    raw,
    settings,
)
from tests.support import store_env

__all__ = ["artifact_backend", "raw", "settings"]

_artifacts = ArtifactRow.__table__  # type: ignore[attr-defined]
PARTIAL = b"first half of the output\n"


def _abandoned(manager: ArtifactManager, data: bytes = PARTIAL) -> tuple[str, Path]:
    """A spill whose writer died: allocated, some bytes written, never finalized."""
    slot = manager.allocate_path("bash")
    with open(slot.path, "wb") as out:
        out.write(data)
    return slot.id, slot.path


def _state(manager: ArtifactManager, artifact_id: str) -> tuple[str, int]:
    (row,) = [a for a in manager.list() if a.local_id == artifact_id]
    return row.state, row.size_bytes


def _age(store: SessionStore, path: Path | None, seconds: float) -> None:
    """Make the rows (and the written file) ``seconds`` old instead of sleeping."""
    with store.engine.begin() as conn:
        conn.execute(update(_artifacts).values(created_at=utcnow() - timedelta(seconds=seconds)))
    if path is not None and path.exists():
        then = time.time() - seconds
        os.utime(path, (then, then))


def _expire(store: SessionStore, *, apply: bool) -> dict[str, object]:
    return expire_artifacts(store.engine, store.oversized, apply=apply).to_dict()


def _stale_age(settings: Settings) -> float:
    return settings.staging_max_age_seconds + 60


# --- the row's state -------------------------------------------------------------------------


def test_a_spill_killed_mid_write_is_refused_as_incomplete_not_served_whole(
    store: SessionStore, raw: RawArtifacts
) -> None:
    sid = store.create_session(tenant_id="acme").id
    manager = store.artifacts(sid)
    artifact_id, _ = _abandoned(manager)
    with pytest.raises(ArtifactIncomplete) as refused:
        store.resolve(f"artifact://{artifact_id}", session_id=sid)
    assert refused.value.state == "writing"
    assert _state(manager, artifact_id) == ("writing", 0)
    assert "incomplete" in refused.value.message and "--partial" in refused.value.message
    seen = store.resolve(f"artifact://{artifact_id}", session_id=sid, partial=True)
    assert not seen.complete and "incomplete" in seen.notes[0]
    assert seen.to_dict()["complete"] is False
    # on S3 the bytes wait in the writer's spool until a finalize uploads them whole
    assert seen.content == (PARTIAL.decode() if raw.on_files else "")


def test_an_abandoned_sink_leaves_a_writing_row_and_a_finished_one_a_complete_row(
    store: SessionStore,
) -> None:
    manager = store.artifacts(store.create_session(tenant_id="acme").id)
    abandoned = OutputSink(target=manager, tool_type="bash", spill_bytes=10)
    abandoned.push("x" * 100)  # spilled, then the process "dies": no dump, no finalize
    assert abandoned._file is not None
    abandoned._file.close()  # what the kernel does for a killed process
    finished = OutputSink(target=manager, tool_type="bash", spill_bytes=10)
    finished.push("y" * 100)
    done = finished.dump()
    assert done.artifact_id == "1"
    assert _state(manager, "0") == ("writing", 0)
    assert _state(manager, "1") == ("complete", 100)
    resolved = store.resolve("artifact://1", session_id=manager.session_id)
    assert resolved.complete and resolved.content == "y" * 100


def test_whole_writes_are_complete_rows(store: SessionStore) -> None:
    manager = store.artifacts(store.create_session(tenant_id="acme").id)
    saved = manager.save("whole", "bash")
    manager.put_tool_output("7", "bash", b"put whole")
    manager.save_agent_output("review", "# done")
    assert {a.local_id: a.state for a in manager.list()} == {
        saved: "complete",
        "7": "complete",
        "0-review": "complete",
    }


def test_a_put_over_a_writing_row_makes_it_complete(store: SessionStore) -> None:
    """An import replacing an id a dead writer left: the new bytes are whole."""
    manager = store.artifacts(store.create_session(tenant_id="acme").id)
    artifact_id, _ = _abandoned(manager)
    manager.put_tool_output(artifact_id, "bash", b"imported whole")
    assert _state(manager, artifact_id) == ("complete", 14)


def test_the_state_index_lists_each_artifacts_state(store: SessionStore) -> None:
    sid = store.create_session(tenant_id="acme").id
    manager = store.artifacts(sid)
    manager.save("whole", "bash")
    _abandoned(manager)
    listed = store.state(sid).to_dict()["artifacts"]
    assert [(a["local_id"], a["state"]) for a in listed] == [("0", "complete"), ("1", "writing")]


# --- expiry settles what a dead writer left ----------------------------------------------------


def test_expiry_marks_a_dead_writers_output_truncated_keeping_its_bytes(
    store: SessionStore, raw: RawArtifacts
) -> None:
    sid = store.create_session(tenant_id="acme").id
    manager = store.artifacts(sid)
    artifact_id, path = _abandoned(manager)
    _age(store, path, _stale_age(store.settings))

    dry = _expire(store, apply=False)
    assert (dry["stale_writes_truncated"], dry["stale_write_bytes"]) == (1, len(PARTIAL))
    assert _state(manager, artifact_id) == ("writing", 0)  # a dry run changes nothing

    applied = _expire(store, apply=True)
    assert (applied["stale_writes_truncated"], applied["stale_writes_completed"]) == (1, 0)
    assert applied["stale_write_bytes"] == len(PARTIAL) and applied["errors"] == []
    assert _state(manager, artifact_id) == ("truncated", len(PARTIAL))
    with pytest.raises(ArtifactIncomplete, match=f"{len(PARTIAL)} bytes were saved"):
        store.resolve(f"artifact://{artifact_id}", session_id=sid)
    kept = store.resolve(f"artifact://{artifact_id}", session_id=sid, partial=True)
    assert kept.content == PARTIAL.decode() and not kept.complete
    assert "truncated" in kept.notes[0]
    # on S3 the spool this machine held was uploaded (and kept for a writer that was only
    # slow: test_on_s3_a_spool_no_writer_finalizes_is_swept_after_the_staging_age)
    target = manager.directory() / f"{artifact_id}.bash.log"
    assert raw.read(target) == PARTIAL
    assert _expire(store, apply=True)["stale_writes_truncated"] == 0  # settled once


def test_expiry_leaves_a_young_or_still_growing_output_writing(store: SessionStore) -> None:
    manager = store.artifacts(store.create_session(tenant_id="acme").id)
    young, _ = _abandoned(manager)
    assert _expire(store, apply=True)["stale_writes_truncated"] == 0
    assert _state(manager, young)[0] == "writing"
    # an old row whose file is still written to: a long tool run, not a dead writer
    _age(store, None, _stale_age(store.settings))
    assert _expire(store, apply=True)["stale_writes_truncated"] == 0
    assert _state(manager, young)[0] == "writing"


def test_expiry_settles_a_writer_that_died_before_its_first_byte(store: SessionStore) -> None:
    sid = store.create_session(tenant_id="acme").id
    manager = store.artifacts(sid)
    slot = manager.allocate_path("bash")  # killed before the file was created
    _age(store, None, _stale_age(store.settings))
    report = _expire(store, apply=True)
    assert (report["stale_writes_truncated"], report["stale_write_bytes"]) == (1, 0)
    assert _state(manager, slot.id) == ("truncated", 0)
    assert store.resolve(f"artifact://{slot.id}", session_id=sid, partial=True).content == ""


def test_a_finalize_after_expiry_took_the_writer_for_dead_wins(
    store: SessionStore, raw: RawArtifacts
) -> None:
    """A writer silent past the staging age, then back: it streams on into the file it
    holds open and finalizes. On S3 expiry had uploaded and unlinked its spool, so the
    finalize failed (no such spooled output) and the rest of the output was lost."""
    sid = store.create_session(tenant_id="acme").id
    manager = store.artifacts(sid)
    slot = manager.allocate_path("bash")
    with open(slot.path, "wb") as out:  # as a streaming writer holds it: open throughout
        out.write(PARTIAL)
        out.flush()
        _age(store, slot.path, _stale_age(store.settings))
        assert _expire(store, apply=True)["stale_writes_truncated"] == 1
        out.write(b"and the rest\n")
    manager.finalize_tool_output(slot.id)
    assert _state(manager, slot.id) == ("complete", len(PARTIAL) + 13)
    resolved = store.resolve(f"artifact://{slot.id}", session_id=sid)
    assert resolved.complete and resolved.content == PARTIAL.decode() + "and the rest\n"


@pytest.mark.parametrize("artifact_backend", ["s3"])
def test_on_s3_a_spool_no_writer_finalizes_is_swept_after_the_staging_age(
    store: SessionStore, raw: RawArtifacts
) -> None:
    """Expiry uploads a dead writer's spool and keeps it (the writer may be slow only); one
    unchanged for the staging age again, its row settled, is removed (a young one is not,
    nor a still-writing row's)."""
    sid = store.create_session(tenant_id="acme").id
    manager = store.artifacts(sid)
    artifact_id, spool = _abandoned(manager)
    _age(store, spool, _stale_age(store.settings))
    first = _expire(store, apply=True)
    assert first["stale_writes_truncated"] == 1 and spool.exists()
    assert store.resolve(f"artifact://{artifact_id}", session_id=sid, partial=True).content == (
        PARTIAL.decode()
    )
    assert _expire(store, apply=True)["stale_spools"] == 0  # the writer may yet come back
    young_id, young = _abandoned(store.artifacts(sid))  # a writer at work: row and file young
    then = time.time() - 2 * _stale_age(store.settings)
    os.utime(spool, (then, then))  # unchanged for the staging age again: no one came back
    assert _expire(store, apply=False)["stale_spools"] == 1
    assert _expire(store, apply=True)["stale_spools"] == 1
    assert not spool.exists() and young.exists()
    assert _state(manager, young_id) == ("writing", 0)


@pytest.mark.parametrize("artifact_backend", ["s3"])
def test_on_s3_an_upload_whose_commit_died_is_completed_by_expiry(
    store: SessionStore, raw: RawArtifacts
) -> None:
    """A finalize uploads the whole spooled file, then commits: a crash between the two
    leaves the whole object under a writing row. Only a finalize uploads, so it is whole."""
    sid = store.create_session(tenant_id="acme").id
    manager = store.artifacts(sid)
    artifact_id, spool = _abandoned(manager)
    target = manager.directory() / f"{artifact_id}.bash.log"
    store.artifact_storage.put(key_of(raw.root, target), PARTIAL)
    spool.unlink()
    _age(store, None, _stale_age(store.settings))
    report = _expire(store, apply=True)
    assert (report["stale_writes_completed"], report["stale_writes_truncated"]) == (1, 0)
    assert _state(manager, artifact_id) == ("complete", len(PARTIAL))
    assert store.resolve(f"artifact://{artifact_id}", session_id=sid).content == PARTIAL.decode()


# --- forks and exports ---------------------------------------------------------------------------


def test_a_fork_holds_none_of_an_output_still_being_written_and_says_so(
    store: SessionStore,
) -> None:
    """Its writer is the parent's: the fork's row is ``truncated`` at 0 bytes, not
    ``writing`` with no writer of its own (``test_fork_inflight``)."""
    parent = store.create_session(tenant_id="acme").id
    manager = store.artifacts(parent)
    manager.save("whole", "bash")
    artifact_id, _ = _abandoned(manager)
    fork = store.fork(parent)
    assert fork.copy_status == "copied"
    forked = store.artifacts(fork.id)
    assert {a.local_id: (a.state, a.size_bytes) for a in forked.list()} == {
        "0": ("complete", 5),
        "1": ("truncated", 0),
    }
    with pytest.raises(ArtifactIncomplete, match="0 bytes were saved"):
        store.resolve(f"artifact://{artifact_id}", session_id=fork.id)
    assert store.resolve("artifact://0", session_id=fork.id).content == "whole"


def test_export_leaves_out_an_output_that_is_not_whole_and_says_so(
    store: SessionStore, tmp_path: Path
) -> None:
    sid = store.create_session(tenant_id="acme").id
    manager = store.artifacts(sid)
    whole = manager.save("whole", "bash")
    partial, _ = _abandoned(manager)
    done = export_omp(store, sid, tmp_path / "out", blobs_dir=tmp_path / "blobs")
    assert sorted(p.name for p in done.artifacts_dir.iterdir()) == [f"{whole}.bash.log"]
    assert done.incomplete_artifacts == [(partial, "writing")]
    assert done.to_dict()["incomplete_artifacts"] == [[partial, "writing"]]


def test_a_row_gone_missing_is_still_not_found(store: SessionStore) -> None:
    sid = store.create_session(tenant_id="acme").id
    store.artifacts(sid).save("whole", "bash")
    with pytest.raises(ResolveNotFound, match="Available: 0"):
        store.resolve("artifact://5", session_id=sid)


# --- the CLI and a real kill ---------------------------------------------------------------


@FILE_ONLY
def test_the_cli_refuses_an_incomplete_output_in_one_line_and_reads_it_with_partial(
    store: SessionStore, settings: Settings
) -> None:
    sid = store.create_session(tenant_id="acme").id
    artifact_id, _ = _abandoned(store.artifacts(sid))
    env = store_env(settings)
    refused = run_cli("read", f"artifact://{artifact_id}", "--session", sid, env=env)
    assert refused.returncode == 1, refused.stderr
    assert refused.stdout == ""
    (line,) = refused.stderr.splitlines()
    assert line.startswith(f"error: artifact://{artifact_id} is incomplete")
    read = run_cli("read", f"artifact://{artifact_id}", "--session", sid, "--partial", env=env)
    assert read.returncode == 0, read.stderr
    assert read.stdout == PARTIAL.decode()
    assert "# incomplete: still being written" in read.stderr
    exported = run_cli(
        "export", sid, "--format", "omp", "-o", str(settings.data_dir / "x"), env=env
    )
    assert exported.returncode == 1
    assert "error: 1 tool output(s) not exported, not whole" in exported.stderr.splitlines()[-1]


_WRITER = """
import sys
from core import SessionStore, Settings
settings = Settings(data_dir=sys.argv[1], database_url=sys.argv[2])
store = SessionStore.from_settings(settings)
sink = store.artifacts(sys.argv[3]).output_sink("bash")
chunk = "line of a long build log\\n" * 100
while True:
    sink.push(chunk)
    if sink._file is not None and sink._file.tell() > 400_000:
        sink._file.flush()
        print("spilled", flush=True)
        sys.stdin.readline()  # killed here, mid-write
"""


@FILE_ONLY
def test_a_writer_killed_by_sigkill_mid_write_leaves_an_incomplete_output(
    store: SessionStore, settings: Settings
) -> None:
    sid = store.create_session(tenant_id="acme").id
    argv = [sys.executable, "-c", _WRITER, str(settings.data_dir)]
    argv += [settings.resolved_database_url, sid]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as writer:
        try:
            assert writer.stdout is not None and writer.stdout.readline() == "spilled\n"
        finally:
            writer.send_signal(signal.SIGKILL)
            writer.wait(timeout=30)
    manager = store.artifacts(sid)
    (row,) = manager.list()
    written = (session_dir(settings.resolved_artifact_root, "acme", sid) / row.name).stat().st_size
    assert row.state == "writing" and written > 400_000
    with pytest.raises(ArtifactIncomplete):
        store.resolve(f"artifact://{row.local_id}", session_id=sid)
    _age(
        store,
        session_dir(settings.resolved_artifact_root, "acme", sid) / row.name,
        _stale_age(settings),
    )
    assert _expire(store, apply=True)["stale_write_bytes"] == written
    assert _state(manager, row.local_id) == ("truncated", written)
