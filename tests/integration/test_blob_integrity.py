"""Invariant 13: a corrupt blob is never trusted, served or kept (issue 16, item 1)."""

from __future__ import annotations

import base64
import gzip
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from core import SessionStore
from core.blobs.files import FileBlobStore
from core.blobs.store import parse_blob_name, sha256_hex
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


def test_a_blob_that_cannot_be_repaired_is_reported_and_the_others_are_repaired(
    store: SessionStore, tmp_path: Path
) -> None:
    """A directory standing at a blob's file: its repair fails (the good copy cannot be put
    there), is reported with why, and the run goes on to repair the next blob (a probe's
    finding: the run stopped there with a bare "[Errno 21] Is a directory", exit 3, no
    report, and the blobs after it were never repaired)."""
    good = tmp_path / "known-good"
    good.mkdir()
    first, second = sorted((store.blobs.put(content).hash, content) for content in (TEXT, MEDIA))
    for blob_hash, content in (first, second):
        (good / blob_hash).write_bytes(content)
    blocked = _blob_file(store, first[0])
    blocked.unlink()
    blocked.mkdir()  # a directory, where the first blob's file goes
    _blob_file(store, second[0]).unlink()
    report = verify_blobs(store.blobs, repair_from=good)
    assert report.missing == [first[0], second[0]]
    assert report.repaired == [second[0]] and store.blobs.get(second[0]) == second[1]
    assert [u.split(": ")[0] for u in report.unrepaired] == [first[0]]
    assert "directory" in report.unrepaired[0].lower()
    assert not report.healthy and report.to_dict()["unrepaired_count"] == 1
    assert blocked.is_dir()


def test_a_damaged_file_under_the_other_codec_never_shadows_the_registered_one(
    store: SessionStore,
) -> None:
    """A good registered ``.blob`` (identity) with a damaged ``.blob.gz`` beside it: the
    registered file is read first, so the blob is served, re-puts keep its codec, and
    verify finds it healthy and moves neither file."""
    result = store.blobs.put(MEDIA)
    blobs = store.blobs
    assert isinstance(blobs, FileBlobStore) and result.codec == "identity"
    good = blobs.path_for(result.hash, "identity")
    blobs.path_for(result.hash, "gzip").write_bytes(b"\x1f\x8b garbage")

    assert blobs.get(result.hash) == MEDIA
    assert blobs.put(MEDIA).codec == "identity" and not blobs.put(MEDIA).written
    report = verify_blobs(blobs)
    assert report.ok == 1 and report.quarantined == [] and report.healthy
    assert good.read_bytes() == MEDIA
    info = blobs.info(result.hash)
    assert info is not None and info.codec == "identity"


def test_verify_quarantines_only_the_bad_one_of_two_files(store: SessionStore) -> None:
    """The registered identity file is damaged and a good gzip copy lies beside it: verify
    moves the damaged one only, and the blob is served from the other."""
    result = store.blobs.put(MEDIA)
    blobs = store.blobs
    assert isinstance(blobs, FileBlobStore)
    _flip(blobs.path_for(result.hash, "identity"))
    blobs.path_for(result.hash, "gzip").write_bytes(gzip.compress(MEDIA))

    report = verify_blobs(blobs)
    [aside] = report.quarantined
    assert parse_blob_name(Path(aside).name, stamped=True) == (result.hash, "identity")
    assert report.ok == 1 and report.corrupt == [] and report.healthy
    assert blobs.get(result.hash) == MEDIA


def test_verify_repairs_from_files_named_as_the_corrupt_directory_names_them(
    store: SessionStore, tmp_path: Path
) -> None:
    """``--repair-from <blob root>/corrupt``: a good copy there (``<hash>.blob.<stamp>``)
    brings a missing blob back."""
    result = store.blobs.put(MEDIA)
    path = _blob_file(store, result.hash)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    os.replace(path, corrupt / f"{path.name}.20260101T000000123456")

    report = verify_blobs(store.blobs, repair_from=corrupt)
    assert report.missing == [result.hash] and report.repaired == [result.hash]
    assert report.healthy and store.blobs.get(result.hash) == MEDIA


def test_a_file_an_interrupted_gc_left_aside_is_found_by_exists_and_verify(
    store: SessionStore,
) -> None:
    """A GC that died between moving a registered blob's file aside (``.gc``) and its
    commit: ``exists`` and ``blobs verify`` put the file back, as ``get`` does."""
    result = store.blobs.put(TEXT)
    assert store.blobs.quarantine_file(result.hash)  # what GC does; then the "crash"
    assert store.blobs.exists(result.hash)
    report = verify_blobs(store.blobs)
    assert report.ok == 1 and report.missing == [] and report.healthy
    assert _blob_file(store, result.hash).name.endswith(".blob.gz")
    assert store.blobs.get(result.hash) == TEXT


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


@pytest.mark.parametrize(
    "text", [TEXT.decode(), base64.b64encode(MEDIA).decode()], ids=["text", "base64-text"]
)
def test_a_link_at_a_blob_file_is_a_damaged_copy_reported_kept_and_repaired_by_a_put(
    store: SessionStore, tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str
) -> None:
    """A symlink where a blob's file should be (planted; a restore that kept links) is read
    as a damaged copy, never followed: reads report it and keep the ref, as for a corrupt
    file, and a put of the content renames a new file over the link itself (its target
    untouched). Before, every read of every session referencing the blob failed with
    SymlinkRefused, and so did the put that would have repaired it."""
    session = store.create_session(tenant_id="t")
    store.append(session.id, [{"type": "custom", "data": text}])
    [raw] = store.read(session.id)
    ref = raw.payload["data"]
    blob_hash = ref.rsplit(":", 1)[1]
    content = text.encode()
    path = _blob_file(store, blob_hash)
    target = tmp_path / "elsewhere"
    target.write_bytes(path.read_bytes())  # even the right bytes: a link is never trusted
    path.unlink()
    os.symlink(target, path)

    with pytest.raises(BlobCorrupted, match="symlink"):
        store.blobs.get(blob_hash)
    with pytest.raises(BlobCorrupted, match="symlink"):
        store.blobs.peek(blob_hash, 10)
    with caplog.at_level(logging.WARNING):
        [event] = store.read(session.id, rehydrate=True)
    assert event.payload["data"] == ref  # the ref, kept
    assert any(r.__dict__.get("blob_hash") == blob_hash for r in caplog.records)
    assert store.state(session.id, rehydrate=True).seq == 1

    again = store.blobs.put(content)
    assert again.written
    assert not path.is_symlink() and store.blobs.get(blob_hash) == content
    assert target.read_bytes() != b"" and target.is_file()  # the link's target untouched
    [event] = store.read(session.id, rehydrate=True)
    assert event.payload["data"] == text


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


def test_stored_digests_are_bounded_most_recently_used_and_forget() -> None:
    from core.blobs.digests import StoredDigests

    digests = StoredDigests(max_entries=2)
    for name in ("a", "b", "c"):
        digests.record(name * 64, "gzip", name.encode(), 1)
    assert not digests.matches("a" * 64, "gzip", b"a")  # the least recently used went first
    assert digests.matches("b" * 64, "gzip", b"b") and digests.matches("c" * 64, "gzip", b"c")
    assert not digests.matches("c" * 64, "gzip", b"C")
    assert not digests.matches("c" * 64, "identity", b"c")  # identity: always the full check
    digests.record("d" * 64, "identity", b"d", 1)
    assert not digests.matches("d" * 64, "identity", b"d")
    assert digests.matches("b" * 64, "gzip", b"b")  # used: "c" is now the oldest
    digests.record("e" * 64, "gzip", b"e", 1)
    assert digests.matches("b" * 64, "gzip", b"b") and not digests.matches("c" * 64, "gzip", b"c")
    digests.forget("b" * 64)
    assert not digests.matches("b" * 64, "gzip", b"b")


def test_a_digest_vouches_only_for_the_content_size_recorded_with_it(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``blobs verify`` passes the registered size: a wrong one is reported by a process
    that holds the digest exactly as by one that does not."""
    blob_hash = store.blobs.put(TEXT).hash
    inflates = _count_inflates(monkeypatch)
    assert store.blobs.check_stored(blob_hash, len(TEXT)) is None
    assert inflates == []
    problem = store.blobs.check_stored(blob_hash, len(TEXT) + 1)
    assert problem is not None and "size" in problem
    assert inflates == ["gzip"]


class _Flaky(bytearray):
    """A buffer another thread rewrites between two reads of it: each copy differs."""

    def __init__(self, first: bytes, then: bytes) -> None:
        super().__init__(first)
        self.copies = [first, then]

    def __bytes__(self) -> bytes:
        return self.copies.pop(0) if len(self.copies) > 1 else self.copies[0]


def test_a_buffer_changed_during_a_put_is_stored_under_the_hash_of_what_was_stored(
    store: SessionStore,
) -> None:
    other = TEXT.replace(b"fox", b"cat")
    result = store.blobs.put(_Flaky(TEXT, other))  # type: ignore[arg-type]
    assert store.blobs.get(result.hash) == TEXT and result.hash == sha256_hex(TEXT)
    assert not store.blobs.put(TEXT).written  # and the digest it recorded is a true one
    assert store.blobs.get(sha256_hex(TEXT)) == TEXT


def test_a_trusted_file_replaced_by_another_contents_gzip_is_repaired(
    store: SessionStore,
) -> None:
    import zlib

    blob_hash = store.blobs.put(TEXT).hash
    store.blobs.put(TEXT)  # the digest is recorded
    _blob_file(store, blob_hash).write_bytes(zlib.compress(TEXT[:-1] + b"!", 6, wbits=31))
    assert store.blobs.put(TEXT).written
    assert store.blobs.get(blob_hash) == TEXT


def test_bytes_after_the_gzip_stream_make_a_file_corrupt(store: SessionStore) -> None:
    """zlib alone ignores what follows a gzip member: a file with bytes appended is damaged
    (read, re-put and verify all say so), not recorded as good."""
    blob_hash = store.blobs.put(TEXT).hash
    path = _blob_file(store, blob_hash)
    path.write_bytes(path.read_bytes() + b"appended")
    with pytest.raises(BlobCorrupted, match="after the end"):
        store.blobs.get(blob_hash)
    assert not verify_blobs(store.blobs).healthy
    assert store.blobs.put(TEXT).written
    assert store.blobs.get(blob_hash) == TEXT and verify_blobs(store.blobs).healthy


@pytest.mark.parametrize(
    "tail", [b"\x1f\x8b", gzip.compress(b"more", mtime=0)[:-3], b"\x00" * 8], ids=repr
)
def test_a_partial_member_or_padding_after_the_stream_makes_a_file_corrupt(
    store: SessionStore, tail: bytes
) -> None:
    blob_hash = store.blobs.put(TEXT).hash
    path = _blob_file(store, blob_hash)
    path.write_bytes(path.read_bytes() + tail)
    with pytest.raises(BlobCorrupted, match="after the end"):
        store.blobs.get(blob_hash)
    assert not verify_blobs(store.blobs).healthy


def test_a_file_of_several_gzip_members_is_valid_gzip_and_is_served(store: SessionStore) -> None:
    """``cat a.gz b.gz`` is valid gzip (RFC 1952): the members decode to their
    concatenation, checked against the hash as one file is. A member too many is not."""
    blob_hash = store.blobs.put(TEXT).hash
    path = _blob_file(store, blob_hash)
    half = len(TEXT) // 2
    path.write_bytes(gzip.compress(TEXT[:half]) + gzip.compress(TEXT[half:]))
    assert store.blobs.get(blob_hash) == TEXT
    assert verify_blobs(store.blobs).healthy
    path.write_bytes(path.read_bytes() + gzip.compress(b"!"))
    with pytest.raises(BlobCorrupted):
        store.blobs.get(blob_hash)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX")
def test_a_child_forked_while_the_digest_lock_was_held_can_put(store: SessionStore) -> None:
    """Forked while a thread of the parent was inside the digests' lock (here the forking
    thread itself holds it), the child neither inherits the held lock nor hangs."""
    import signal
    import time

    store.blobs.put(TEXT)
    lock = store.blobs.digests._lock
    lock.acquire()
    try:
        pid = os.fork()
        if pid == 0:  # the child: exit codes only, never back into pytest
            code = 1
            try:
                signal.alarm(20)
                store.blobs.digests.record("f" * 64, "gzip", b"x", 1)
                code = 0 if store.blobs.digests.matches("f" * 64, "gzip", b"x") else 2
            finally:
                os._exit(code)
    finally:
        lock.release()
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    if done == (0, 0):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on the inherited digest lock")
    assert os.waitstatus_to_exitcode(done[1]) == 0
