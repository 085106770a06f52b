"""Oversized tool outputs: threshold, ArtifactRef and hint, TTL, cleanup, stats, expiry."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import Connection, Engine, text

from core import SessionNotFound, SessionStore
from core.artifacts import oversized as oversized_module
from core.artifacts.oversized import OVERSIZED_ID, OversizedOutputs
from core.artifacts.paths import oversized_name
from core.artifacts.staging import stage
from core.errors import ArtifactError, StorageUnavailable
from core.models import utcnow
from tests.contract.artifact_backends import RawArtifacts, artifact_backend, raw, settings

__all__ = ["artifact_backend", "raw", "settings"]  # every test runs on file:// and s3://

# Backend-independent behavior: one backend is enough.
SQLITE_ONLY = pytest.mark.parametrize("backend", ["sqlite"])


@pytest.fixture
def sid(store: SessionStore) -> str:
    return store.create_session(tenant_id="acme").id


def test_threshold_boundary(store: SessionStore, sid: str) -> None:
    assert store.store_oversized(sid, "x" * 12_000, "bash") is None  # not over the limit
    stored = store.store_oversized(sid, "x" * 12_001, "bash")
    assert stored is not None and stored.ref.size_bytes == 12_001
    # characters, not bytes: 12,000 two-byte characters are not oversized
    assert store.store_oversized(sid, "é" * 12_000, "bash") is None


def test_ref_and_hint(store: SessionStore, sid: str) -> None:
    content = "first line\nsecond\r\nthird " + "é" * 20_000
    before = utcnow()
    stored = store.store_oversized(sid, content, "mcp/fetch")
    assert stored is not None
    ref, hint = stored  # a (ref, hint) pair
    assert OVERSIZED_ID.match(ref.artifact_id)
    assert ref.size_bytes == len(content.encode())
    assert ref.summary == ("first line second  third " + "é" * 200)[:200]
    assert len(ref.summary) == 200 and "\n" not in ref.summary and "\r" not in ref.summary
    assert ref.ttl_s == 3600 and ref.tool_name == "mcp_fetch"
    assert before <= ref.created_at <= utcnow()
    # expires by the database's clock, created by the host's: here one clock, read twice
    assert (
        timedelta(0)
        <= ref.expires_at - ref.created_at - timedelta(seconds=3600)
        < timedelta(seconds=5)
    )
    assert hint.artifact_reference == ref.artifact_id
    assert hint.summary == ref.summary and hint.size_bytes == ref.size_bytes
    assert ref.artifact_id in hint.hint and "20,025 characters" in hint.hint
    assert set(hint.to_dict()) == {"artifact_reference", "summary", "hint", "size_bytes"}
    assert ref.to_dict()["artifact_id"] == ref.artifact_id
    assert store.retrieve(ref.artifact_id, session_id=sid) == content


@SQLITE_ONLY
def test_short_content_summary(store: SessionStore) -> None:
    small = SessionStore(store.settings.with_overrides(oversized_output_chars=3), store.engine)
    sid = small.create_session(tenant_id="acme").id
    stored = small.store_oversized(sid, "a\nb\nc", "bash")
    assert stored is not None and stored.ref.summary == "a b c"


def test_custom_ttl_and_expiry(store: SessionStore, sid: str, raw: RawArtifacts) -> None:
    stored = store.store_oversized(sid, "y" * 13_000, "bash", ttl_s=60)
    assert stored is not None and stored.ref.ttl_s == 60
    art = stored.ref.artifact_id
    assert store.expire_artifacts().expired == 0
    later = utcnow() + timedelta(seconds=61)
    report = store.oversized.expire(now=later)
    assert report.expired == [(sid, art)] and report.deleted == 0 and not report.applied
    assert store.retrieve(art, session_id=sid) is not None  # a dry run removes nothing
    applied = store.oversized.expire(now=later, apply=True)
    assert applied.deleted == 1 and applied.applied
    assert store.retrieve(art, session_id=sid) is None
    path = store.artifacts(sid).directory() / oversized_name(art)
    assert not raw.exists(path)


def test_retrieve_is_none_once_expired(store: SessionStore, sid: str) -> None:
    stored = store.store_oversized(sid, "z" * 13_000, "bash", ttl_s=1)
    assert stored is not None
    with store.engine.begin() as conn:  # age the row instead of sleeping
        conn.execute(
            text("UPDATE artifacts SET expires_at = created_at WHERE local_id = :id"),
            {"id": stored.ref.artifact_id},
        )
    assert store.retrieve(stored.ref.artifact_id, session_id=sid) is None


@SQLITE_ONLY
def test_retrieve_is_none_when_the_file_is_missing(
    store: SessionStore, sid: str, raw: RawArtifacts
) -> None:
    stored = store.store_oversized(sid, "w" * 13_000, "bash")
    assert stored is not None
    raw.delete(store.artifacts(sid).directory() / oversized_name(stored.ref.artifact_id))
    assert store.retrieve(stored.ref.artifact_id, session_id=sid) is None


@SQLITE_ONLY
def test_retrieve_unknown_or_malformed_ids(store: SessionStore, sid: str) -> None:
    assert store.retrieve("art_0123456789abcdef", session_id=sid) is None
    assert store.retrieve("../../etc/passwd", session_id=sid) is None
    with pytest.raises(SessionNotFound):
        store.retrieve("art_0123456789abcdef", session_id=sid, tenant_id="globex")


@SQLITE_ONLY
def test_invalid_ttl(store: SessionStore, sid: str) -> None:
    # 10**12 s is past the last date: it was a builtin OverflowError, not a typed error
    for ttl in (0, -1, 10**12, 1.5, True, "60"):
        with pytest.raises(ArtifactError, match="ttl_s must be positive"):
            store.store_oversized(sid, "x" * 13_000, "bash", ttl_s=ttl)  # type: ignore[arg-type]
    assert store.artifacts(sid).list() == []


def test_cleanup_session_and_stats(store: SessionStore, sid: str, raw: RawArtifacts) -> None:
    other = store.create_session(tenant_id="globex").id
    sizes = [13_000, 14_000]
    ids = [store.store_oversized(sid, "a" * n, "bash") for n in sizes]
    store.store_oversized(other, "b" * 15_000, "bash")
    stats = store.oversized.stats()
    assert (stats.count, stats.total_bytes) == (3, 42_000)
    assert store.oversized.stats(tenant_id="acme").total_bytes == 27_000
    assert store.artifact_stats()["oversized"].count == 3
    assert store.artifacts(sid).cleanup_oversized() == 2
    for stored in ids:
        assert stored is not None
        assert store.retrieve(stored.ref.artifact_id, session_id=sid) is None
    leftover = raw.keys_under(store.artifacts(sid).directory())
    assert not [k for k in leftover if "/oversized/" in k]
    assert not [k for k in leftover if "/.tmp/" in k]  # staging objects/files were removed
    assert store.oversized.stats().count == 1
    assert store.oversized.cleanup_session(sid) == 0


def test_cleanup_that_fails_midway_leaves_rows_to_retry_never_unnamed_files(
    store: SessionStore, sid: str, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows went in one commit and the files after it: a crash or a failing disk
    between left files no row named, kept forever. Now each output goes file first."""
    stored = [store.store_oversized(sid, c * 13_000, "bash") for c in "abc"]
    real = OversizedOutputs._remove
    removed: list[Path] = []

    def second_fails(self: OversizedOutputs, path: Path) -> None:
        if len(removed) == 1:
            raise StorageUnavailable("artifacts", "disk failing")
        removed.append(path)
        real(self, path)

    monkeypatch.setattr(OversizedOutputs, "_remove", second_fails)
    with pytest.raises(StorageUnavailable):
        store.oversized.cleanup_session(sid)
    assert store.oversized.stats().count == 2  # the two whose files are still there
    monkeypatch.setattr(OversizedOutputs, "_remove", real)
    assert store.oversized.cleanup_session(sid) == 2
    assert store.oversized.stats().count == 0
    leftover = raw.keys_under(store.artifacts(sid).directory())
    assert not [k for k in leftover if "/oversized/" in k] and all(stored)


@SQLITE_ONLY
def test_manager_shortcuts(store: SessionStore, sid: str) -> None:
    manager = store.artifacts(sid)
    assert manager.store_oversized("short", "bash") is None
    stored = manager.store_oversized("q" * 12_001, "bash")
    assert stored is not None
    assert manager.retrieve(stored.ref.artifact_id) == "q" * 12_001


def _fail_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write transaction of the oversized outputs raises once its block ran: the
    commit fails after the file was published."""
    real = oversized_module.write_transaction

    @contextmanager
    def failing(engine: Engine) -> Iterator[Connection]:
        with real(engine) as conn:
            yield conn
            raise StorageUnavailable("database", "injected: the commit failed")

    monkeypatch.setattr(oversized_module, "write_transaction", failing)


def test_a_store_whose_commit_fails_leaves_no_file(
    store: SessionStore, sid: str, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The published file stayed (``keep_new``) with no row naming it, and no expiry ever
    found it (review 4, t1)."""
    _fail_commit(monkeypatch)
    with pytest.raises(StorageUnavailable):
        store.store_oversized(sid, "x" * 20_000, "bash")
    monkeypatch.undo()
    assert raw.keys_under(store.artifacts(sid).directory()) == []
    assert store.oversized.stats().count == 0


def test_a_staged_publish_whose_commit_fails_leaves_no_file(
    store: SessionStore, sid: str, raw: RawArtifacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``publish_staged`` (a rehydrated export's output) with a file staged as the build
    stages it (new files kept on discard): the failed commit removes what it published."""
    directory = store.artifacts(sid).directory()
    staged = stage(store.oversized.storage, store.oversized.root, directory, b"{}\n" * 5000)
    _fail_commit(monkeypatch)
    with pytest.raises(StorageUnavailable):
        store.oversized.publish_staged(
            sid,
            staged,
            tool_name="rehydrate-pi",
            summary="s",
            size=15_000,
            sha256="0" * 64,
            ttl_s=60,
        )
    monkeypatch.undo()
    assert raw.keys_under(directory) == []
