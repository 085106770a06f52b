"""Driver errors leave the storage boundary typed, on both backends (core/translate.py).

The database stopped gives ``StorageUnavailable``; a value the database refuses (its
DataError, a string it cannot encode, a number out of its range) gives ``InvalidEvent``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

import core.artifacts.oversized as oversized_module
from core import SessionStore, Settings, nofollow
from core.artifacts.paths import oversized_name, session_dir
from core.blobs.files import FileBlobStore
from core.errors import ConcurrencyConflict, InvalidEvent, StorageUnavailable
from core.query import EventFilter, analytics
from core.translate import is_unavailable, translated
from tests.support import DiskFull, FileFault, TcpProxy, clean_env, set_output_expiry


@pytest.fixture
def cut_store(
    backend: str, database_url: str, tmp_path: Path
) -> Iterator[tuple[SessionStore, TcpProxy | Path]]:
    """A store whose database can be taken away: a cuttable proxy (PostgreSQL) or a
    folder that can be moved from under it (SQLite)."""
    if backend == "postgres":
        proxy = TcpProxy(("127.0.0.1", 5432))
        url = database_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        settings = Settings(data_dir=tmp_path / "data", database_url=url)
        with SessionStore.from_settings(settings) as store:
            yield store, proxy
        proxy.cut()
        return
    folder = tmp_path / "db"
    folder.mkdir()
    path = folder / "journal.db"
    shutil.copyfile(database_url.removeprefix("sqlite:///"), path)
    settings = Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{path}")
    with SessionStore.from_settings(settings) as store:
        yield store, folder


def _stop(store: SessionStore, handle: TcpProxy | Path) -> None:
    if isinstance(handle, TcpProxy):
        handle.cut()
    else:
        handle.rename(handle.with_name("gone"))
    store.engine.dispose()  # pooled connections would hide the outage


def test_database_stopped_gives_storage_unavailable(
    cut_store: tuple[SessionStore, TcpProxy | Path],
) -> None:
    store, handle = cut_store
    sid = store.create_session(tenant_id="acme").id
    store.append(sid, [{"type": "note", "n": 1}])
    _stop(store, handle)
    with pytest.raises(StorageUnavailable) as info:
        store.append(sid, [{"type": "note", "n": 2}], idempotency_key="k2")
    assert info.value.component == "database"
    with pytest.raises(StorageUnavailable):
        store.read(sid)
    with pytest.raises(StorageUnavailable):
        store.dead_letters.list()
    assert is_unavailable(info.value)
    # the analysts' reads too (they gave the driver's own OperationalError)
    for read in (
        lambda: store.list_events(),
        lambda: store.stats(),
        lambda: analytics.head_position(store.engine),
        lambda: next(analytics.follow_events(store.engine, after_position=0)),
        lambda: next(iter(analytics.iter_events(store.engine))),
    ):
        with pytest.raises(StorageUnavailable):
            read()


@pytest.mark.parametrize("backend", ["postgres"])  # SQLite has no server to lose
@pytest.mark.parametrize(("keyed", "blob"), [(False, False), (True, False), (True, True)])
def test_connections_the_server_dropped_fail_one_append_and_are_not_used_again(
    store: SessionStore, keyed: bool, blob: bool
) -> None:
    """The pool's connections lose their server processes (a restart, a failover, an idle
    timeout): the append that finds one fails as StorageUnavailable and nothing lands; the
    pool is then renewed, so the next append lands instead of finding the next dead one."""
    import psycopg

    sid = store.create_session(tenant_id="acme").id
    with store.engine.connect() as a, store.engine.connect() as b:  # two pooled connections
        a.execute(text("SELECT 1"))
        b.execute(text("SELECT 1"))
    store.append(sid, [{"type": "note", "n": 1}])
    url = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as admin:
        gone = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
    assert gone is not None and gone[0] >= 2

    key = {"idempotency_key": "k"} if keyed else {}
    # a large string goes to the blob store: the append is then a transaction (its blob
    # registered in it), not the one autocommit statement
    big = {"out": "x" * (store.settings.inline_string_limit + 1)} if blob else {}
    with pytest.raises(StorageUnavailable):
        store.append(sid, [{"type": "note", "n": 2, **big}], **key)  # type: ignore[arg-type]
    store.append(sid, [{"type": "note", "n": 3, **big}], **key)  # type: ignore[arg-type]
    assert [e.payload["n"] for e in store.read(sid)] == [1, 3]


@pytest.mark.parametrize("backend", ["postgres"])  # the driver-cursor append
def test_an_exit_while_the_append_runs_closes_that_connection(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SystemExit (a signal handler's) raised while the append statement runs leaves its
    connection in an unknown state: it is invalidated and closed, never pooled again, as
    SQLAlchemy does with an exit it sees."""
    import psycopg

    sid = store.create_session(tenant_id="acme").id
    used: list[Any] = []
    real_execute = psycopg.Cursor.execute

    def interrupted(self: Any, *args: Any, **kwargs: Any) -> Any:
        used.append(self.connection)
        raise SystemExit(1)

    monkeypatch.setattr(psycopg.Cursor, "execute", interrupted)
    with pytest.raises(SystemExit):
        store.append(sid, [{"type": "note"}])
    monkeypatch.setattr(psycopg.Cursor, "execute", real_execute)
    assert len(used) == 1 and used[0].closed
    store.append(sid, [{"type": "note"}])
    assert store.get_session(sid).head_seq == 1


@pytest.mark.parametrize(
    ("case", "kwargs"),
    [
        ("seq beyond 64 bits", {"expected_seq": 2**64}),
        ("seq beyond bigint", {"expected_seq": 2**63}),
        ("lone surrogate in key", {"idempotency_key": "k\ud800"}),
    ],
)
def test_value_the_database_refuses_gives_invalid_event(
    store: SessionStore, case: str, kwargs: dict[str, object]
) -> None:
    sid = store.create_session(tenant_id="acme").id
    with pytest.raises(InvalidEvent):
        store.append(sid, [{"type": "note"}], **kwargs)  # type: ignore[arg-type]
    assert store.read(sid) == []


def test_lone_surrogate_session_id_gives_invalid_event(store: SessionStore) -> None:
    with pytest.raises(InvalidEvent):
        store.append("s\udc00", [{"type": "note"}])
    # what argv makes of a byte that is not UTF-8, in the analysts' filters: typed too
    # (a raw UnicodeEncodeError before)
    bad = "t\udcff"
    for read in (
        lambda: store.list_events(EventFilter(tenant_id=bad)),
        lambda: store.list_events(EventFilter(types=(bad,))),
        lambda: store.list_events(EventFilter(roles=(bad,))),
        lambda: store.stats(tenant_id=bad),
        lambda: next(
            analytics.follow_events(store.engine, EventFilter(tenant_id=bad), after_position=0)
        ),
    ):
        with pytest.raises(InvalidEvent):
            read()


def test_database_data_error_gives_invalid_event(store: SessionStore, backend: str) -> None:
    """The driver's own DataError, straight from the database, through the boundary."""
    store.create_session(tenant_id="acme")
    if backend == "postgres":  # (every argument of the store's own calls is checked first)
        with pytest.raises(InvalidEvent, match=r"NUL|0x00"):  # PostgreSQL text refuses NUL
            _through_the_boundary(store, "s\x00", "CAST(:value AS text)")
    else:
        with pytest.raises(InvalidEvent, match="too large"):
            _through_the_boundary(store, 2**63 + 1)


@translated
def _through_the_boundary(store: SessionStore, value: object, expr: str = ":value") -> None:
    with store.engine.connect() as conn:
        conn.execute(text(f"SELECT {expr}"), {"value": value})


def test_dead_letters_store_any_value(store: SessionStore) -> None:
    """The dead-letter table never refuses a write it must keep."""
    letter = store.dead_letters.record(
        idempotency_key="k\x00\ud800",
        session_id="s\x00\udfff",
        events=[{"type": "x\ud800", "v": "\x00", "n": 2**70}],
        expected_seq=2**64,
        error=InvalidEvent("/type", "bad \ud800"),
    )
    again = store.dead_letters.get(letter.id)
    assert again.events == [{"type": "x\ud800", "v": "\x00", "n": 2**70}]
    assert again.expected_seq is None and "2**64" not in again.error
    assert "18446744073709551616" in again.error
    assert "\x00" not in again.session_id + again.idempotency_key


def test_a_write_dead_lettered_again_is_kept_once(store: SessionStore) -> None:
    """A message dead-lettered and then delivered again (its worker lost before the ack, a
    resend) was kept once per delivery; each letter replayed the same write. Now it is
    kept once; other events, another reason or another head are other letters."""

    def record(events: Any = None, error: Exception | None = None, seq: int | None = 3) -> int:
        return store.dead_letters.record(
            idempotency_key="k\ud800",
            session_id="s",
            events=[{"type": "x", "n": 2**70}] if events is None else events,
            expected_seq=seq,
            error=error or InvalidEvent("/type", "bad"),
        ).id

    first = record()
    assert record() == first and record(error=InvalidEvent("/type", "worded otherwise")) == first
    others = {
        record(events=[{"type": "y"}]),
        record(error=ConcurrencyConflict("s", 3, 4)),
        record(seq=None),
    }
    assert first not in others and len(others) == 3
    assert record(seq=None) in others and store.dead_letters.count() == 4


def test_a_message_kept_raw_and_delivered_again_is_kept_once(store: SessionStore) -> None:
    """The same for a message that never reached the task (its worker killed between the
    letter and the ack): it was kept once per delivery. Other bytes, another content type
    or another reason are other letters."""

    def record(
        body: bytes = b"[1, 2", content_type: str = "application/json", reason: str = "r"
    ) -> int:
        return store.dead_letters.record_raw(
            body=body,
            content_type=content_type,
            content_encoding="utf-8",
            reason=reason,
            message_id="k",
            session_id="s",
        ).id

    first = record()
    assert record() == first
    others = {record(body=b"[1, 3"), record(content_type="text/plain"), record(reason="r2")}
    assert first not in others and len(others) == 3 and store.dead_letters.count() == 4


def test_full_blob_disk_gives_storage_unavailable_and_the_write_lands_once_space_is_back(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk under the blob store is transient, not bad input: the append raises
    ``StorageUnavailable("blobs")`` (which the queue retries and the CLI reports as storage
    unavailable), commits nothing, and the same append lands once there is space again."""
    assert isinstance(store.blobs, FileBlobStore)
    fault = DiskFull(store.blobs.root)
    monkeypatch.setattr(os, "write", fault.write)
    sid = store.create_session(tenant_id="acme").id
    big = {"type": "message", "message": {"role": "user", "content": "x" * 100_000}}
    fault.full.set()
    with pytest.raises(StorageUnavailable) as info:
        store.append(sid, [big], idempotency_key="k")
    assert info.value.component == "blobs" and "No space left" in info.value.message
    assert is_unavailable(info.value) and fault.refused >= 1
    assert store.read(sid) == []
    fault.full.clear()
    result = store.append(sid, [big], idempotency_key="k")
    assert (result.first_seq, result.replayed) == (1, False)
    assert store.read(sid, rehydrate=True)[0].payload == big


def test_full_artifact_disk_gives_storage_unavailable_and_writes_once_space_is_back(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for blobs: a tool output or an oversized output on a full disk is transient."""
    fault = DiskFull(store.settings.resolved_artifact_root)
    monkeypatch.setattr(os, "write", fault.write)
    sid = store.create_session(tenant_id="acme").id
    artifacts = store.artifacts(sid)
    big = "line\n" * 5000
    fault.full.set()
    with pytest.raises(StorageUnavailable) as info:
        artifacts.save("output", "bash")
    assert info.value.component == "artifacts" and "No space left" in info.value.message
    with pytest.raises(StorageUnavailable):
        store.store_oversized(sid, big, "bash")
    assert artifacts.list() == [] and fault.refused >= 2
    fault.full.clear()
    assert store.resolve(f"artifact://{artifacts.save('output', 'bash')}", session_id=sid)
    stored = store.store_oversized(sid, big, "bash")
    assert stored is not None and artifacts.retrieve(stored.ref.artifact_id) == big


# A failing disk (EIO) under the artifact or blob files, at each step that touches them: the
# typed, transient StorageUnavailable naming the store, never a raw OSError; a missing file
# keeps its meaning. The fault sits at one os call (tests.support.FileFault), under one root.


def _artifacts_of(store: SessionStore) -> tuple[str, str, str]:
    """(session id, tool-output id, oversized-output id) with a file ``notes/a.txt``."""
    sid = store.create_session(tenant_id="acme").id
    artifacts = store.artifacts(sid)
    tool_id = artifacts.save("tool output\n", "bash")
    artifacts.files.put("notes/a.txt", "kept")
    stored = store.store_oversized(sid, "x" * 20_000, "bash")
    assert stored is not None
    return sid, tool_id, stored.ref.artifact_id


def _artifact_disk_fails(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, *calls: str
) -> FileFault:
    """EIO from the named ``os`` calls under the artifact root, until ``failing`` is cleared."""
    return FileFault(store.settings.resolved_artifact_root).install(monkeypatch, *calls)


def _unavailable(component: str, action: Callable[[], object]) -> StorageUnavailable:
    with pytest.raises(StorageUnavailable) as info:
        action()
    assert info.value.component == component, info.value
    assert "Input/output error" in info.value.message and is_unavailable(info.value)
    return info.value


def test_artifact_reads_on_a_failing_disk_give_storage_unavailable(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid, tool_id, art_id = _artifacts_of(store)
    artifacts = store.artifacts(sid)
    fault = _artifact_disk_fails(store, monkeypatch, "open")

    _unavailable("artifacts", lambda: store.resolve(f"artifact://{tool_id}", session_id=sid))
    _unavailable("artifacts", lambda: artifacts.files.get("notes/a.txt"))
    _unavailable("artifacts", lambda: artifacts.retrieve(art_id))
    _unavailable("artifacts", lambda: store.resolve(art_id, session_id=sid))
    fault.failing.clear()
    assert artifacts.files.get("notes/a.txt") == b"kept"
    assert artifacts.retrieve(art_id) == "x" * 20_000
    # A missing file is still no content, not an unavailable store.
    next(store.settings.resolved_artifact_root.rglob("art_*")).unlink()
    assert artifacts.retrieve(art_id) is None


def test_artifact_deletes_on_a_failing_disk_give_storage_unavailable_and_keep_the_file(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid, _tool_id, art_id = _artifacts_of(store)
    artifacts = store.artifacts(sid)
    fault = _artifact_disk_fails(store, monkeypatch, "replace", "unlink")

    _unavailable("artifacts", lambda: artifacts.files.delete("notes/a.txt"))
    _unavailable("artifacts", artifacts.cleanup_oversized)
    assert fault.refused >= 2
    fault.failing.clear()
    assert artifacts.files.get("notes/a.txt") == b"kept"  # the delete rolled back
    artifacts.files.delete("notes/a.txt")
    assert [f.local_id for f in artifacts.files.list()] == []
    # the output whose file could not go keeps its row (file first, then row): kept, and
    # the next cleanup removes it
    assert artifacts.retrieve(art_id) == "x" * 20_000
    assert artifacts.cleanup_oversized() == 1
    assert artifacts.retrieve(art_id) is None


def test_a_move_on_a_failing_disk_gives_storage_unavailable_and_changes_nothing(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid, _tool_id, _art_id = _artifacts_of(store)
    fault = _artifact_disk_fails(store, monkeypatch, "rename")

    _unavailable("artifacts", lambda: store.move(sid, tenant_id="globex"))
    fault.failing.clear()
    assert store.get_session(sid).tenant_id == "acme"
    assert store.artifacts(sid).files.get("notes/a.txt") == b"kept"
    assert store.move(sid, tenant_id="globex").tenant_id == "globex"
    assert store.artifacts(sid).files.get("notes/a.txt") == b"kept"


def test_expiry_on_a_failing_disk_reports_the_unavailable_store_and_stops(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a failing disk expiry stops at the first file it cannot remove, and keeps its row:
    the next run removes it (it deleted the row first, and the file stayed forever, found by
    nothing)."""
    sid, _tool_id, first = _artifacts_of(store)
    second = store.store_oversized(sid, "y" * 20_000, "bash")
    assert second is not None
    for art_id in (first, second.ref.artifact_id):
        set_output_expiry(store, art_id, timedelta(seconds=-10))
    fault = _artifact_disk_fails(store, monkeypatch, "unlink")

    report = store.expire_artifacts(apply=True, batch_size=1)
    [error] = report.errors
    assert "artifacts is unavailable" in error and "Input/output error" in error
    assert report.deleted == 0 and fault.refused == 1
    fault.failing.clear()
    assert store.expire_artifacts(apply=True).deleted == 2  # both, next run
    oversized = session_dir(
        store.settings.resolved_artifact_root, store.get_session(sid).tenant_id, sid
    ) / oversized_name(first)
    assert not nofollow.exists(store.settings.resolved_artifact_root, oversized)


def test_expiry_that_dies_between_the_file_and_its_row_is_finished_by_the_next_run(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database goes away after the file is removed: the row left behind reads as
    expired, and the next run removes it (nothing is left that no run would find)."""
    sid, _tool_id, art_id = _artifacts_of(store)
    set_output_expiry(store, art_id, timedelta(seconds=-10))
    real = oversized_module.rows.delete_artifact

    def database_gone(*args: object, **kwargs: object) -> bool:
        raise StorageUnavailable("database")

    monkeypatch.setattr(oversized_module.rows, "delete_artifact", database_gone)
    report = store.expire_artifacts(apply=True)
    assert report.deleted == 0 and report.errors, report
    monkeypatch.setattr(oversized_module.rows, "delete_artifact", real)
    assert store.retrieve(art_id, session_id=sid) is None  # its file is gone: expired
    assert store.expire_artifacts(apply=True).deleted == 1
    assert store.expire_artifacts(apply=True).deleted == 0


def test_a_stale_directory_the_disk_fails_to_remove_is_unavailable_not_bad_input(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty directory left where a file goes is removed before the write; EIO on that
    rmdir is the storage failing (it was "a directory is in the way", bad input, kept)."""
    sid = store.create_session(tenant_id="acme").id
    files = store.artifacts(sid).files
    files.put("keep.txt", "x")
    stale = session_dir(store.settings.resolved_artifact_root, "acme", sid) / "files" / "n.md"
    stale.mkdir()
    fault = _artifact_disk_fails(store, monkeypatch, "rmdir")
    _unavailable("artifacts", lambda: files.put("n.md", "hello"))
    fault.failing.clear()
    files.put("n.md", "hello")
    assert files.get("n.md") == b"hello"


def test_blob_reads_and_deletes_on_a_failing_disk_give_storage_unavailable(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The steps ``get`` takes besides the read itself (putting back a file a dead GC moved
    aside), and the deletes and moves of GC and verify."""
    blobs = store.blobs
    assert isinstance(blobs, FileBlobStore)
    put = blobs.put(b"some text content " * 200)
    fault = FileFault(blobs.root).install(monkeypatch, "replace", "unlink")

    _unavailable("blobs", lambda: blobs.quarantine_file(put.hash))
    _unavailable("blobs", lambda: blobs.remove_file(put.hash))
    fault.failing.clear()
    moved = blobs.quarantine_file(put.hash)  # as a GC that then died
    fault.failing.set()
    _unavailable("blobs", lambda: blobs.get(put.hash))
    _unavailable("blobs", lambda: blobs.purge_quarantined(moved))
    fault.failing.clear()
    assert blobs.get(put.hash) == b"some text content " * 200  # put back, then read


_CLI_WITH_A_FAILING_DISK = """
import os, sys
from pathlib import Path
from tests.support import FileFault
fault = FileFault(Path(sys.argv[1]))
os.open = fault.wrap(os.open)
from tasks.cli import main
main(sys.argv[2:])
"""


@pytest.mark.slow
def test_the_cli_reading_an_artifact_on_a_failing_disk_exits_6_with_one_line(
    tmp_path: Path,
) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    with SessionStore.from_settings(settings) as store:
        sid, tool_id, _art_id = _artifacts_of(store)
        root = store.settings.resolved_artifact_root
    env = clean_env(tmp_path / "data")
    args = [str(root), "read", f"artifact://{tool_id}", "--session", sid]
    result = subprocess.run(
        [sys.executable, "-c", _CLI_WITH_A_FAILING_DISK, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        timeout=120,
        check=False,
    )
    assert result.returncode == 6, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: artifact store unavailable: ") and "Input/output error" in line
