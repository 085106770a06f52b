"""Driver errors leave the storage boundary typed, on both backends (core/translate.py).

The database stopped gives ``StorageUnavailable``; a value the database refuses (its
DataError, a string it cannot encode, a number out of its range) gives ``InvalidEvent``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from core import SessionStore, Settings
from core.blobs.files import FileBlobStore
from core.errors import InvalidEvent, StorageUnavailable
from core.translate import is_unavailable
from tests.support import DiskFull, TcpProxy


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


def test_database_data_error_gives_invalid_event(store: SessionStore, backend: str) -> None:
    """The driver's own DataError, straight from the database, through the boundary."""
    sid = store.create_session(tenant_id="acme").id
    if backend == "postgres":
        with pytest.raises(InvalidEvent, match=r"NUL|0x00"):  # PostgreSQL text refuses NUL
            store.append("s\x00", [{"type": "note"}], idempotency_key="k")
    else:  # (append checks expected_seq itself now: a read's bound reaches the driver)
        with pytest.raises(InvalidEvent, match="too large"):
            store.read(sid, after_seq=2**63 + 1)


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
