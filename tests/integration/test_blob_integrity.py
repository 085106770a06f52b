"""Invariant 13: a corrupt blob is never trusted, served or kept (issue 16, item 1)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from core import SessionStore
from core.blobs.files import FileBlobStore
from core.blobs.store import sha256_hex
from core.blobs.verify import verify_blobs
from core.errors import BlobCorrupted

TEXT = b"".join(b"line %d: the quick brown fox\n" % i for i in range(3000))  # gzip codec
MEDIA = b"\x89PNG\r\n\x1a\n" + os.urandom(20_000)  # identity codec


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE: dict[str, Callable[[Path], None]] = {"truncate": _truncate, "flip": _flip}


def _blob_file(store: SessionStore, blob_hash: str) -> Path:
    blobs = store.blobs
    assert isinstance(blobs, FileBlobStore)
    found = [p for p in blobs.root.rglob(f"{blob_hash}.blob*") if p.is_file()]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("content", [TEXT, MEDIA], ids=["gzip", "identity"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_corrupt_blob_repair_by_put_read_raises_and_verify_quarantines(
    store: SessionStore, damage: str, content: bytes
) -> None:
    blob_hash = store.blobs.put(content).hash
    DAMAGE[damage](_blob_file(store, blob_hash))

    with pytest.raises(BlobCorrupted):
        store.blobs.get(blob_hash)

    again = store.blobs.put(content)  # a re-put verifies the file and replaces it
    assert again.written
    assert store.blobs.get(blob_hash) == content
    assert verify_blobs(store.blobs).healthy

    DAMAGE[damage](_blob_file(store, blob_hash))
    report = verify_blobs(store.blobs)
    assert report.corrupt == [blob_hash] and report.missing == []
    assert len(report.quarantined) == 1 and Path(report.quarantined[0]).exists()
    assert not report.healthy
    assert not store.blobs.has_stored(blob_hash)  # never served again
    # the next run sees it as missing (the row is kept: events still reference it)
    assert verify_blobs(store.blobs).missing == [blob_hash]


def test_verify_repairs_from_a_directory_and_reports_unregistered(
    store: SessionStore, tmp_path: Path
) -> None:
    good = tmp_path / "known-good"
    good.mkdir()
    corrupt_hash = store.blobs.put(TEXT).hash
    missing_hash = store.blobs.put(MEDIA).hash
    (good / corrupt_hash).write_bytes(TEXT)  # a bare-hash file of raw bytes
    # a copy in the store's own layout and codec
    good_copy = good / "ab" / _blob_file(store, missing_hash).name
    good_copy.parent.mkdir()
    good_copy.write_bytes(_blob_file(store, missing_hash).read_bytes())
    _flip(_blob_file(store, corrupt_hash))
    _blob_file(store, missing_hash).unlink()
    blobs = store.blobs
    assert isinstance(blobs, FileBlobStore)
    stray = sha256_hex(b"never registered")
    stray_path = blobs.path_for(stray, "identity")
    stray_path.parent.mkdir(parents=True, exist_ok=True)
    stray_path.write_bytes(b"never registered")

    seen: list[tuple[str, int, int | None]] = []
    report = verify_blobs(blobs, repair_from=good, progress=lambda *a: seen.append(a))

    assert report.corrupt == [corrupt_hash] and report.missing == [missing_hash]
    assert sorted(report.repaired) == sorted([corrupt_hash, missing_hash])
    assert report.unregistered == [stray]
    assert report.healthy
    assert blobs.get(corrupt_hash) == TEXT and blobs.get(missing_hash) == MEDIA
    assert seen and seen[-1] == ("blobs", 2, 2)


def test_a_wrong_known_good_file_is_not_used(store: SessionStore, tmp_path: Path) -> None:
    blob_hash = store.blobs.put(TEXT).hash
    _truncate(_blob_file(store, blob_hash))
    (tmp_path / blob_hash).write_bytes(b"not the content")
    report = verify_blobs(store.blobs, repair_from=tmp_path)
    assert report.repaired == [] and not report.healthy


def test_rehydrating_read_keeps_the_ref_of_a_corrupt_blob(
    store: SessionStore, caplog: pytest.LogCaptureFixture
) -> None:
    session = store.create_session(tenant_id="t")
    big = TEXT.decode() * 3
    store.append(session.id, [{"type": "custom", "data": big}])
    [raw] = store.read(session.id)
    ref = raw.payload["data"]
    blob_hash = ref.rsplit(":", 1)[1]
    _flip(_blob_file(store, blob_hash))
    with caplog.at_level(logging.WARNING):
        [event] = store.read(session.id, rehydrate=True)
    assert event.payload["data"] == ref
    assert any(r.__dict__.get("blob_hash") == blob_hash for r in caplog.records)


# --- re-puts verify the stored bytes by the digest this process recorded (issue 19.2) -------


def _count_inflates(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every full check of stored content (inflate + hash), by codec."""
    import core.blobs.store as store_module

    calls: list[str] = []
    real = store_module.decode_blob

    def counting(codec: str, stored: bytes) -> bytes:
        calls.append(codec)
        return real(codec, stored)  # type: ignore[arg-type]

    monkeypatch.setattr(store_module, "decode_blob", counting)
    return calls


def test_a_re_put_of_a_gzip_blob_this_process_wrote_hashes_the_stored_bytes_only(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = store.blobs.put(TEXT)
    assert first.codec == "gzip" and first.written
    inflates = _count_inflates(monkeypatch)
    for _ in range(3):
        again = store.blobs.put(TEXT)
        assert not again.written and again.hash == first.hash
    assert inflates == []  # proven by the stored bytes' digest, not by inflating them
    # a store that did not write it (another process) checks it in full, once
    other = SessionStore.from_settings(store.settings)
    try:
        assert not other.blobs.put(TEXT).written
        assert not other.blobs.put(TEXT).written
    finally:
        other.close()
    assert inflates == ["gzip"]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_file_never_matches_the_recorded_digest(
    store: SessionStore, damage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    blob_hash = store.blobs.put(TEXT).hash
    store.blobs.put(TEXT)  # trusted by digest from here on
    DAMAGE[damage](_blob_file(store, blob_hash))
    inflates = _count_inflates(monkeypatch)
    again = store.blobs.put(TEXT)
    assert again.written  # repaired from the put's content, not trusted
    assert inflates == ["gzip"]
    assert store.blobs.get(blob_hash) == TEXT and verify_blobs(store.blobs).healthy


def test_other_valid_gzip_bytes_of_the_same_content_get_the_full_check(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file rewritten with other bytes that decode to the same content (another gzip
    level, say by ``blobs verify --repair-from`` in another process) is not what the digest
    recorded: it is checked in full, found good, and its digest recorded in turn."""
    import zlib

    blob_hash = store.blobs.put(TEXT).hash
    path = _blob_file(store, blob_hash)
    path.write_bytes(zlib.compress(TEXT, 1, wbits=31))
    inflates = _count_inflates(monkeypatch)
    assert not store.blobs.put(TEXT).written
    assert not store.blobs.put(TEXT).written
    assert inflates == ["gzip"]


def test_stored_digests_are_bounded_and_forget() -> None:
    from core.blobs.digests import StoredDigests

    digests = StoredDigests(max_entries=2)
    for name in ("a", "b", "c"):
        digests.record(name * 64, "gzip", name.encode())
    assert not digests.matches("a" * 64, "gzip", b"a")  # the oldest went first
    assert digests.matches("b" * 64, "gzip", b"b") and digests.matches("c" * 64, "gzip", b"c")
    assert not digests.matches("c" * 64, "gzip", b"C")
    assert not digests.matches("c" * 64, "identity", b"c")  # identity: always the full check
    digests.record("d" * 64, "identity", b"d")
    assert not digests.matches("d" * 64, "identity", b"d")
    digests.forget("c" * 64)
    assert not digests.matches("c" * 64, "gzip", b"c")
