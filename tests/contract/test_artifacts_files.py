"""Path-addressed files: put/get/list/delete, quotas at their boundaries, concurrency."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pytest

from core import SessionStore, Settings
from core.artifacts import ArtifactManager
from core.artifacts.paths import FILES_DIR, STAGING_DIR
from core.errors import ArtifactNotFound, InvalidArtifactPath, QuotaExceeded
from tests.contract.artifact_backends import (
    FILE_ONLY,
    RawArtifacts,
    artifact_backend,
    raw,
    settings,
)

__all__ = ["FILE_ONLY", "artifact_backend", "raw", "settings"]  # each test on file:// and s3://

FILE_CAP = 100
SESSION_CAP = 250
TENANT_CAP = 400

# Backend-independent behavior: one backend is enough.
SQLITE_ONLY = pytest.mark.parametrize("backend", ["sqlite"])


@pytest.fixture
def small(settings: Settings) -> Iterator[SessionStore]:
    """A store with tiny quotas, so every boundary is cheap to reach."""
    tight = settings.with_overrides(
        quota_file_bytes=FILE_CAP, quota_session_bytes=SESSION_CAP, quota_tenant_bytes=TENANT_CAP
    )
    with SessionStore.from_settings(tight) as s:
        yield s


def _manager(store: SessionStore, tenant: str = "acme") -> ArtifactManager:
    return store.artifacts(store.create_session(tenant_id=tenant).id)


# --- basic operations ------------------------------------------------------------------------


def test_put_get_list_delete(store: SessionStore, raw: RawArtifacts) -> None:
    manager = _manager(store)
    first = manager.files.put("notes\\todo.md", "- [ ] ship")
    assert first.path == "notes/todo.md" and first.size_bytes == 10
    assert (first.session_used_bytes, first.tenant_used_bytes, first.replaced_bytes) == (10, 10, 0)
    manager.files.put("data/blob.bin", b"\x00\x01\x02")
    manager.files.put("data/sub/x.json", "{}")
    assert manager.files.get("notes//todo.md/") == b"- [ ] ship"
    assert raw.read(manager.directory() / "files" / "notes" / "todo.md") == b"- [ ] ship"
    listed = manager.files.list()
    assert [(f.local_id, f.media_type) for f in listed] == [
        ("data/blob.bin", "application/octet-stream"),
        ("data/sub/x.json", "application/json"),
        ("notes/todo.md", "text/markdown"),
    ]
    assert [f.local_id for f in manager.files.list("data")] == ["data/blob.bin", "data/sub/x.json"]
    assert [f.local_id for f in manager.files.list("data/sub/x.json")] == ["data/sub/x.json"]
    assert manager.files.list("dat") == []
    assert manager.files.stat("data/blob.bin").size_bytes == 3
    removed = manager.files.delete("data/sub/x.json")
    assert (removed.replaced_bytes, removed.session_used_bytes) == (2, 13)
    assert raw.gone(manager.directory() / "files" / "data" / "sub")  # emptied dirs pruned
    with pytest.raises(ArtifactNotFound):
        manager.files.get("data/sub/x.json")
    with pytest.raises(ArtifactNotFound):
        manager.files.delete("data/sub/x.json")


@SQLITE_ONLY
def test_invalid_paths_never_touch_disk(store: SessionStore, raw: RawArtifacts) -> None:
    manager = _manager(store)
    for bad in ("../escape", "/abs", "a/.hidden", "con.txt", "c:x", ""):
        with pytest.raises(InvalidArtifactPath):
            manager.files.put(bad, "x")
        with pytest.raises(InvalidArtifactPath):
            manager.files.get(bad)
    assert raw.gone(manager.directory())


@SQLITE_ONLY
def test_explicit_media_type(store: SessionStore) -> None:
    manager = _manager(store)
    manager.files.put("report", b"%PDF", media_type="application/pdf")
    manager.files.put("plain", "text")
    assert [f.media_type for f in manager.files.list()] == ["text/plain", "application/pdf"]


def test_file_and_directory_cannot_share_a_path(store: SessionStore) -> None:
    manager = _manager(store)
    manager.files.put("a", "file")
    with pytest.raises(InvalidArtifactPath, match="conflicts with the existing file 'a'"):
        manager.files.put("a/b", "x")
    manager.files.put("c/d/e", "x")
    with pytest.raises(InvalidArtifactPath, match="conflicts with the existing file 'c/d/e'"):
        manager.files.put("c/d", "x")
    with pytest.raises(InvalidArtifactPath, match="conflicts"):
        manager.files.put("c", "x")
    manager.files.delete("c/d/e")
    manager.files.put("c", "now a file")  # the emptied directories no longer block it
    assert manager.files.get("c") == b"now a file"


def test_like_wildcards_in_paths_are_literal(store: SessionStore) -> None:
    manager = _manager(store)
    manager.files.put("a%/x", "1")
    manager.files.put("a_/y", "2")
    manager.files.put("ab/z", "3")
    assert [f.local_id for f in manager.files.list("a%")] == ["a%/x"]
    assert [f.local_id for f in manager.files.list("a_")] == ["a_/y"]


# --- quotas at their boundaries ---------------------------------------------------------------


def test_per_file_quota(small: SessionStore) -> None:
    manager = _manager(small)
    assert manager.files.put("max", b"x" * FILE_CAP).size_bytes == FILE_CAP
    with pytest.raises(QuotaExceeded) as info:
        manager.files.put("over", b"x" * (FILE_CAP + 1))
    assert (info.value.scope, info.value.limit, info.value.requested) == ("file", 100, 101)
    assert info.value.to_dict()["scope"] == "file"
    assert manager.files.usage().session_used_bytes == FILE_CAP


def test_per_session_quota(small: SessionStore, raw: RawArtifacts) -> None:
    manager = _manager(small)
    manager.files.put("a", b"x" * 100)
    manager.files.put("b", b"x" * 100)
    assert manager.files.put("c", b"x" * 50).session_used_bytes == SESSION_CAP  # exactly full
    with pytest.raises(QuotaExceeded) as info:
        manager.files.put("d", b"x")
    assert (info.value.scope, info.value.used, info.value.requested) == ("session", 250, 1)
    assert "session quota exceeded" in info.value.message
    assert raw.gone(manager.directory() / "files" / "d")
    assert raw.stored_bytes(manager.directory() / "files") == SESSION_CAP


def test_per_tenant_quota_spans_sessions(small: SessionStore) -> None:
    one, two = _manager(small), _manager(small)
    other_tenant = _manager(small, "globex")
    one.files.put("a", b"x" * 100)
    one.files.put("b", b"x" * 100)
    two.files.put("a", b"x" * 100)
    result = two.files.put("b", b"x" * 100)
    assert (result.session_used_bytes, result.tenant_used_bytes) == (200, TENANT_CAP)
    with pytest.raises(QuotaExceeded) as info:
        two.files.put("c", b"x")
    assert (info.value.scope, info.value.used) == ("tenant", TENANT_CAP)
    # another tenant's usage is its own
    assert other_tenant.files.put("a", b"x" * 100).tenant_used_bytes == 100


def test_overwrite_subtracts_the_old_size(small: SessionStore, raw: RawArtifacts) -> None:
    manager = _manager(small)
    manager.files.put("a", b"x" * 100)
    manager.files.put("b", b"x" * 100)
    manager.files.put("c", b"x" * 50)  # session full
    same = manager.files.put("c", b"y" * 50)
    assert (same.replaced_bytes, same.session_used_bytes) == (50, SESSION_CAP)
    with pytest.raises(QuotaExceeded):
        manager.files.put("c", b"y" * 51)
    assert manager.files.get("c") == b"y" * 50  # a rejected overwrite keeps the old content
    smaller = manager.files.put("a", b"z" * 10)
    assert smaller.session_used_bytes == 160
    assert manager.files.put("c", b"w" * 100).session_used_bytes == 210
    assert (
        raw.stored_bytes(manager.directory() / "files")
        == manager.files.usage().session_used_bytes
        == 210
    )


def test_shrinking_always_passes_even_over_a_lowered_quota(
    small: SessionStore, settings: Settings
) -> None:
    manager = _manager(small)
    manager.files.put("a", b"x" * 100)
    manager.files.put("b", b"x" * 100)
    lowered = settings.with_overrides(quota_session_bytes=50, quota_file_bytes=100)
    with SessionStore.from_settings(lowered) as store:
        again = store.artifacts(manager.session_id)
        assert again.files.put("a", b"x" * 90).session_used_bytes == 190
        with pytest.raises(QuotaExceeded):
            again.files.put("a", b"x" * 91)
        assert again.files.delete("b").session_used_bytes == 90


# --- quotas under 8 concurrent writers --------------------------------------------------------


def test_quota_holds_under_eight_concurrent_writers(settings: Settings, raw: RawArtifacts) -> None:
    file_cap, session_cap, tenant_cap = 4_000, 20_000, 30_000
    tight = settings.with_overrides(
        quota_file_bytes=file_cap, quota_session_bytes=session_cap, quota_tenant_bytes=tenant_cap
    )
    with SessionStore.from_settings(tight) as store:
        managers = [_manager(store), _manager(store)]
        reports: list[tuple[int, int, int]] = []
        rejected: list[str] = []
        guard = threading.Lock()
        start = threading.Barrier(8)

        def writer(n: int) -> None:
            rng = random.Random(n)
            manager = managers[n % 2]
            start.wait()
            for i in range(8):
                # shared names make writers overwrite each other's files
                path = f"w/{rng.choice(['a', 'b', 'c', str(n)])}/{i % 3}.bin"
                data = bytes([n]) * rng.randint(500, file_cap)
                try:
                    r = manager.files.put(path, data)
                except QuotaExceeded as exc:
                    with guard:
                        rejected.append(exc.scope)
                    continue
                with guard:
                    reports.append((n % 2, r.session_used_bytes, r.tenant_used_bytes))

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        assert rejected, "the caps were never reached: the test proves nothing"
        assert reports
        assert all(s <= session_cap and t <= tenant_cap for _, s, t in reports)
        for manager in managers:
            usage = manager.files.usage()
            assert usage.session_used_bytes <= session_cap
            assert usage.session_used_bytes == raw.stored_bytes(manager.directory() / "files")
            assert sum(f.size_bytes for f in manager.files.list()) == usage.session_used_bytes
            for f in manager.files.list():
                data = manager.files.get(f.local_id)
                # one writer's bytes, all of them: never a mix of two writers' content
                assert len(data) == f.size_bytes and data == data[:1] * len(data)
            staging = manager.directory() / STAGING_DIR
            assert raw.keys_under(staging) == []
        tenant = managers[0].files.usage().tenant_used_bytes
        assert tenant <= tenant_cap
        assert tenant == sum(raw.stored_bytes(m.directory() / "files") for m in managers)


def test_usage_matches_disk_after_mixed_operations(store: SessionStore, raw: RawArtifacts) -> None:
    manager = _manager(store)
    rng = random.Random(3)
    for i in range(40):
        path = f"d{rng.randint(0, 3)}/f{rng.randint(0, 5)}"
        if rng.random() < 0.25:
            try:
                manager.files.delete(path)
            except ArtifactNotFound:
                pass
        else:
            manager.files.put(path, "é" * rng.randint(0, 300) + str(i))
    assert manager.files.usage().session_used_bytes == raw.stored_bytes(
        manager.directory() / "files"
    )


@SQLITE_ONLY
@FILE_ONLY  # directories of the filesystem layout
def test_stale_directory_left_on_disk_is_cleared(store: SessionStore) -> None:
    manager = _manager(store)
    manager.files.put("keep", "x")
    (manager.directory() / FILES_DIR / "ghost").mkdir()
    manager.files.put("ghost", "now a file")
    assert manager.files.get("ghost") == b"now a file"
