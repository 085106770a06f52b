"""The blob store contract (invariants 2, 6 and 9), run on each journal backend."""

from __future__ import annotations

import gzip
import os
import resource
import time
import tracemalloc
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import obstore
import pytest
from sqlalchemy import Engine

import core.blobs.objects as blob_objects
import core.blobs.store as blob_module
from core.blobs.backends import open_blob_store
from core.blobs.files import FileBlobStore
from core.blobs.objects import ObjectBlobStore
from core.blobs.store import (
    BLOB_REF_PREFIX,
    BlobIndex,
    BlobStore,
    Codec,
    StreamDecoder,
    decode_blob,
    encode_blob,
    is_valid_hash,
    make_ref,
    parse_ref,
    sha256_hex,
)
from core.blobs.verify import verify_blobs
from core.db import make_engine
from core.errors import (
    BlobCorrupted,
    BlobError,
    BlobNotFound,
    InvalidBlobHash,
    StorageUnavailable,
)
from core.models import BlobRow
from core.query.preview import for_blobs

PNG = b"\x89PNG\r\n\x1a\n"
TEXT = b"".join(b"line %d: the quick brown fox jumps over the lazy dog\n" % i for i in range(2000))
GOOD = sha256_hex(b"x")
LARGE = 64 * 1024 * 1024  # a large text blob, for the bounded-memory reads
BAD_HASHES = [
    "../../x",
    "../" + GOOD[3:],
    GOOD.upper(),
    GOOD[:63],
    GOOD + "0",
    GOOD[:63] + "g",
    GOOD + "\n",
    "",
    GOOD[:2] + "/" + GOOD[3:],
]


def png_like(size: int = 50_000) -> bytes:
    return PNG + os.urandom(size)


def stored_files(store: FileBlobStore) -> list[Path]:
    return sorted(p for p in store.root.rglob("*") if p.is_file())


class RawObjects:
    """Direct access to what a backend stored, bypassing the store: to inspect its layout
    and to corrupt it. Keys are ``ab/cd/<hash><suffix>`` on every backend."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store

    def key(self, blob_hash: str, codec: Codec) -> str:
        if isinstance(self.store, FileBlobStore):
            return self.store.path_for(blob_hash, codec).relative_to(self.store.root).as_posix()
        assert isinstance(self.store, ObjectBlobStore)
        return self.store.key_for(blob_hash, codec)

    def keys(self) -> list[str]:
        if isinstance(self.store, FileBlobStore):
            return [p.relative_to(self.store.root).as_posix() for p in stored_files(self.store)]
        assert isinstance(self.store, ObjectBlobStore)
        return sorted(m["path"] for page in obstore.list(self.store.store) for m in page)

    def read(self, blob_hash: str, codec: Codec) -> bytes:
        if isinstance(self.store, FileBlobStore):
            return self.store.path_for(blob_hash, codec).read_bytes()
        assert isinstance(self.store, ObjectBlobStore)
        key = self.store.key_for(blob_hash, codec)
        return bytes(obstore.get(self.store.store, key).bytes())

    def write(self, key: str, data: bytes) -> None:
        if isinstance(self.store, FileBlobStore):
            path = self.store.root / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            return
        assert isinstance(self.store, ObjectBlobStore)
        obstore.put(self.store.store, key, data)


class BlobStoreContract:
    """Each backend supplies ``blob_store``; the tests below are the contract."""

    @pytest.fixture
    def url(self) -> str:
        raise NotImplementedError

    @pytest.fixture
    def engine(self, url: str) -> Iterator[Engine]:
        engine = make_engine(url)
        yield engine
        engine.dispose()

    @pytest.fixture
    def blob_store(self, engine: Engine, tmp_path: Path) -> BlobStore:
        raise NotImplementedError

    @pytest.fixture
    def raw(self, blob_store: BlobStore) -> RawObjects:
        return RawObjects(blob_store)

    # round trips and layout -------------------------------------------------------------

    @pytest.mark.parametrize(
        ("data", "codec"),
        [
            (TEXT, "gzip"),
            (png_like(), "identity"),
            (b"\xff\xd8\xff\xe0" + TEXT, "identity"),  # JPEG magic: never gzipped
            (b"GIF89a" + TEXT, "identity"),
            (b"RIFF\x00\x00\x00\x00WEBPVP8 " + TEXT, "identity"),
            (os.urandom(10_000), "identity"),  # incompressible
            (b"", "identity"),
            (b"a", "identity"),
        ],
    )
    def test_put_get_round_trip(self, blob_store: BlobStore, data: bytes, codec: str) -> None:
        result = blob_store.put(data)
        assert result.hash == sha256_hex(data)
        assert (result.size, result.codec, result.written) == (len(data), codec, True)
        assert result.ref == BLOB_REF_PREFIX + result.hash
        assert blob_store.get(result.hash) == data
        assert blob_store.exists(result.hash)

    def test_layout_and_gzip_encoding(self, blob_store: BlobStore, raw: RawObjects) -> None:
        text, image = blob_store.put(TEXT), blob_store.put(png_like())
        t, i = text.hash, image.hash
        stored = raw.read(t, "gzip")
        assert gzip.decompress(stored) == TEXT
        assert text.stored_size == len(stored) < len(TEXT)
        assert raw.keys() == sorted(
            [f"{t[0:2]}/{t[2:4]}/{t}.blob.gz", f"{i[0:2]}/{i[2:4]}/{i}.blob"]
        )

    def test_codec_needs_ten_percent_saving(self) -> None:
        noise = os.urandom(900)
        for zeros in range(0, 400, 10):
            data = noise + bytes(zeros)
            ratio = len(zlib.compress(data, 6, wbits=31)) / len(data)
            codec, payload = encode_blob(data)
            assert codec == ("identity" if ratio > 0.9 else "gzip"), (zeros, ratio)
            assert payload == (data if codec == "identity" else zlib.compress(data, 6, wbits=31))

    def test_registers_a_row_on_put(self, blob_store: BlobStore) -> None:
        result = blob_store.put(TEXT)
        info = blob_store.info(result.hash)
        assert info is not None
        assert (info.size, info.stored_size, info.codec) == (len(TEXT), result.stored_size, "gzip")
        assert info.created_at == info.last_written_at

    # dedup and re-put -------------------------------------------------------------------

    def test_identical_content_is_one_blob(self, blob_store: BlobStore, raw: RawObjects) -> None:
        first = blob_store.put(TEXT)
        again = blob_store.put_many([TEXT, TEXT, b"other"])
        assert [r.hash for r in again] == [first.hash, first.hash, sha256_hex(b"other")]
        assert [r.written for r in again] == [False, False, True]
        assert len(raw.keys()) == 2
        assert blob_store.stats().blob_count == 2

    def test_every_put_refreshes_last_written_at(self, blob_store: BlobStore) -> None:
        h = blob_store.put(TEXT).hash
        before = blob_store.info(h)
        time.sleep(0.01)
        blob_store.put(TEXT)
        after = blob_store.info(h)
        assert before is not None and after is not None
        assert after.last_written_at > before.last_written_at
        assert after.created_at == before.created_at

    def test_reput_skips_the_existing_file(
        self, blob_store: BlobStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        blob_store.put(TEXT)
        writes: list[str] = []
        real_write = blob_store._write
        monkeypatch.setattr(
            blob_store, "_write", lambda h, *a: writes.append(h) or real_write(h, *a)
        )
        if isinstance(blob_store, FileBlobStore):  # its batches write through _write_all
            real_all = blob_store._write_all
            monkeypatch.setattr(blob_store, "_write_all", lambda f: writes.extend(f) or real_all(f))
        assert blob_store.put(TEXT).written is False
        assert writes == []

    def test_refresh_reports_only_stored_blobs(self, blob_store: BlobStore) -> None:
        kept, gone = blob_store.put(TEXT).hash, blob_store.put(b"gone").hash
        blob_store.remove_file(gone)
        assert blob_store.refresh([kept, gone, sha256_hex(b"never")]) == {kept: len(TEXT)}

    # invariant 6: a put always leaves a registered row AND a file -----------------------

    def test_put_recreates_a_file_gc_removed(self, blob_store: BlobStore) -> None:
        h = blob_store.put(TEXT).hash
        assert blob_store.remove_file(h) is True
        assert not blob_store.exists(h)
        assert blob_store.put(TEXT).written is True
        assert blob_store.get(h) == TEXT

    def test_put_recreates_a_file_removed_before_its_row_lock(
        self, blob_store: BlobStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        blob_store.put(TEXT)  # on disk and registered: the put will only re-check it
        h = sha256_hex(TEXT)
        real = blob_objects.retry_deadlocks  # the registration transaction, either protocol

        def gc_then_register(register: Any) -> Any:
            blob_store.remove_file(h)  # GC wins the race before the row lock
            return real(register)

        for module in (blob_module, blob_objects):
            monkeypatch.setattr(module, "retry_deadlocks", gc_then_register)
        if isinstance(blob_store, ObjectBlobStore):  # on SQLite: a short registration first
            short = ObjectBlobStore._register_then_check
            monkeypatch.setattr(
                ObjectBlobStore,
                "_register_then_check",
                lambda self, *a: gc_then_register(lambda: short(self, *a)),
            )
        result = blob_store.put(TEXT)
        assert result.written is True
        assert blob_store.get(h) == TEXT
        info = blob_store.info(h)
        assert info is not None and info.stored_size == result.stored_size

    def test_remove_file_and_iter_files(self, blob_store: BlobStore, raw: RawObjects) -> None:
        assert list(blob_store.iter_files()) == []
        a, b = blob_store.put(TEXT), blob_store.put(png_like())
        raw.write(f"{a.hash[0:2]}/{a.hash[2:4]}/.tmp-leftover.part", b"partial")
        raw.write("README", b"not a blob")
        files = {f.hash: f for f in blob_store.iter_files()}
        assert set(files) == {a.hash, b.hash}
        assert (files[a.hash].codec, files[b.hash].codec) == ("gzip", "identity")
        assert files[a.hash].stored_size == a.stored_size
        assert blob_store.remove_file(a.hash) is True
        assert blob_store.remove_file(a.hash) is False
        assert {f.hash for f in blob_store.iter_files()} == {b.hash}
        with pytest.raises(BlobNotFound):
            blob_store.get(a.hash)

    # corruption -------------------------------------------------------------------------

    @pytest.mark.parametrize("data", [TEXT, png_like()], ids=["gzip", "identity"])
    def test_flipped_bytes_are_detected(
        self, blob_store: BlobStore, raw: RawObjects, data: bytes
    ) -> None:
        result = blob_store.put(data)
        h, key = result.hash, raw.key(result.hash, result.codec)
        good = raw.read(h, result.codec)
        for where in (0, len(good) // 2, len(good) - 1):
            flipped = bytearray(good)
            flipped[where] ^= 0xFF
            raw.write(key, bytes(flipped))
            with pytest.raises(BlobCorrupted) as caught:
                blob_store.get(h)
            assert caught.value.blob_hash == h
        raw.write(key, good)
        assert blob_store.get(h) == data

    def test_truncated_and_substituted_files_are_detected(
        self, blob_store: BlobStore, raw: RawObjects
    ) -> None:
        h = blob_store.put(TEXT).hash
        key = raw.key(h, "gzip")
        raw.write(key, raw.read(h, "gzip")[:-40])
        with pytest.raises(BlobCorrupted):
            blob_store.get(h)
        raw.write(key, zlib.compress(b"some other content", 6, wbits=31))
        with pytest.raises(BlobCorrupted, match="does not match its hash"):
            blob_store.get(h)

    @pytest.mark.parametrize("data", [TEXT, png_like()], ids=["gzip", "identity"])
    def test_a_reput_repairs_and_verify_quarantines(
        self, blob_store: BlobStore, raw: RawObjects, data: bytes
    ) -> None:
        result = blob_store.put(data)
        h, key = result.hash, raw.key(result.hash, result.codec)
        good = raw.read(h, result.codec)
        raw.write(key, good[: len(good) // 2])
        assert blob_store.put(data).written  # verified, found bad, replaced
        assert blob_store.get(h) == data
        raw.write(key, good[:-1] + bytes([good[-1] ^ 0x01]))
        report = verify_blobs(blob_store)
        assert report.corrupt == [h] and len(report.quarantined) == 1
        assert key not in raw.keys() and not blob_store.has_stored(h)
        assert verify_blobs(blob_store).missing == [h]

    # streaming reads and previews (invariant 13, in bounded memory) ---------------------

    @pytest.mark.parametrize(
        "data", [TEXT, png_like(), b"", b"a"], ids=["gzip", "identity", "empty", "tiny"]
    )
    def test_peek_gives_the_head_of_the_verified_content(
        self, blob_store: BlobStore, data: bytes
    ) -> None:
        h = blob_store.put(data).hash
        for known in (True, False):  # the digest the put recorded, then a full check
            if not known:
                blob_store.digests.forget(h)
            assert blob_store.peek(h, 240) == data[:240]
            assert blob_store.peek(h, 10**9) == data
            assert blob_store.peek(h, 0) == b""

    def test_peek_reads_gzip_members_back_to_back(
        self, blob_store: BlobStore, raw: RawObjects
    ) -> None:
        h = blob_store.put(TEXT).hash
        half = len(TEXT) // 2
        two = zlib.compress(TEXT[:half], 6, wbits=31) + zlib.compress(TEXT[half:], 6, wbits=31)
        raw.write(raw.key(h, "gzip"), two)  # valid gzip (RFC 1952), as ``get`` reads it
        assert blob_store.get(h) == TEXT
        assert blob_store.peek(h, 10**9) == TEXT
        assert blob_store.peek(h, half + 10) == TEXT[: half + 10]

    def test_a_preview_of_a_large_blob_holds_a_piece_of_it_at_a_time(
        self, blob_store: BlobStore
    ) -> None:
        """64 MB of text previewed with a peak allocation under 8 MB: with the digest the
        put recorded (the rest only hashed) and without it (all inflated and hashed)."""
        block = b"".join(b"line %d: the quick brown fox jumps over\n" % i for i in range(300))
        data = (block * (LARGE // len(block) + 1))[:LARGE]
        put = blob_store.put(data)
        assert put.codec == "gzip"
        del data
        for known in (True, False):
            if not known:
                blob_store.digests.forget(put.hash)
            previewer = for_blobs(blob_store).scoped(lambda: {put.hash})
            tracemalloc.start()
            try:
                shown = previewer.text(put.ref)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert shown.startswith("line 0: the quick brown fox jumps over line 1:"), shown
            assert shown.endswith("… [text 65,536 KB]"), shown
            assert peak < 16 * 1024 * 1024, f"peak {peak:,} bytes (known digest: {known})"

    @pytest.mark.parametrize("known", [True, False], ids=["known-digest", "unknown-digest"])
    def test_a_blob_damaged_in_its_tail_previews_as_corrupt(
        self, blob_store: BlobStore, raw: RawObjects, known: bool
    ) -> None:
        """The damage is megabytes past the bytes a preview shows: only reading (and
        verifying) to the end finds it. Whether this process verified the blob before or
        not, a damaged tail is ``[corrupt blob …]``, never the text it starts with."""
        data = os.urandom(1024 * 1024).hex().encode()  # 2 MB of text, stored gzipped
        put = blob_store.put(data)
        h, key = put.hash, raw.key(put.hash, put.codec)
        assert put.codec == "gzip" and put.stored_size > 4 * 256 * 1024
        good = raw.read(h, put.codec)
        damaged = {
            f"flipped at -{back}": good[:-back] + bytes([good[-back] ^ 0x01]) + good[-back + 1 :]
            for back in (1, 5, 9, 64, 4096)  # ISIZE, CRC-32, the last deflate block
        }
        damaged |= {f"cut by {cut}": good[:-cut] for cut in (1, 8, 40, len(good) // 2)}
        damaged["a byte after the end"] = good + b"\x00"
        for what, stored in damaged.items():
            raw.write(key, stored)
            if not known:
                blob_store.digests.forget(h)
            shown = for_blobs(blob_store).scoped(lambda: {h}).text(put.ref)
            assert shown == f"[corrupt blob {h[:12]}]", what
            assert data[:20].decode() not in shown, what
            with pytest.raises(BlobCorrupted):
                blob_store.peek(h, 240)
        raw.write(key, good)
        shown = for_blobs(blob_store).scoped(lambda: {h}).text(put.ref)
        assert shown.startswith(data[:60].decode()) and shown.endswith("[text 2,048 KB]")

    def test_an_identity_blob_damaged_in_its_tail_is_not_peeked(
        self, blob_store: BlobStore, raw: RawObjects
    ) -> None:
        put = blob_store.put(png_like(1024 * 1024))
        h, key = put.hash, raw.key(put.hash, put.codec)
        good = raw.read(h, "identity")
        for stored in (good[:-1] + bytes([good[-1] ^ 0x01]), good[:-1], good + b"x"):
            raw.write(key, stored)
            with pytest.raises(BlobCorrupted):
                blob_store.peek(h, 240)
            assert (
                for_blobs(blob_store).scoped(lambda: {h}).text(put.ref).startswith("[corrupt blob")
            )

    def test_a_missing_blob_previews_as_missing(self, blob_store: BlobStore) -> None:
        put = blob_store.put(TEXT)
        blob_store.remove_file(put.hash)
        with pytest.raises(BlobNotFound):
            blob_store.peek(put.hash, 240)
        shown = for_blobs(blob_store).scoped(lambda: {put.hash}).text(put.ref)
        assert shown == f"[missing blob {put.hash[:12]}]"

    def test_an_image_previews_from_the_index_without_reading_its_bytes(
        self, blob_store: BlobStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        put = blob_store.put(png_like(100 * 1024))
        blob_store.remove_file(put.hash)  # its bytes are gone; its row says its size

        def no_read(*args: Any) -> Any:
            pytest.fail("an image preview read the blob's bytes")

        for name in ("_open", "_read", "peek", "get"):
            monkeypatch.setattr(blob_store, name, no_read, raising=False)
        previewer = for_blobs(blob_store).scoped(lambda: {put.hash})
        image = {"type": "image", "data": put.ref, "mimeType": "image/png"}
        assert previewer.block(image) == "[image 100 KB]"
        assert previewer.content([{"type": "text", "text": "see"}, image]) == (
            "see | [image 100 KB]"
        )

    # invariant 9: hashes are validated before any path is built -------------------------

    def test_bad_hashes_never_reach_the_storage(
        self, blob_store: BlobStore, raw: RawObjects, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        touched: list[str] = []
        for name in ("_find", "_read", "_open", "_write"):
            monkeypatch.setattr(blob_store, name, lambda *a, n=name: touched.append(n))
        for bad in BAD_HASHES:
            calls = {
                "get": lambda: blob_store.get(bad),  # noqa: B023
                "peek": lambda: blob_store.peek(bad, 10),  # noqa: B023
                "exists": lambda: blob_store.exists(bad),  # noqa: B023
                "info": lambda: blob_store.info(bad),  # noqa: B023
                "remove_file": lambda: blob_store.remove_file(bad),  # noqa: B023
                "refresh": lambda: blob_store.refresh([GOOD, bad]),  # noqa: B023
                "key": lambda: raw.key(bad, "gzip"),  # noqa: B023
                "make_ref": lambda: make_ref(bad),  # noqa: B023
            }
            for what, call in calls.items():
                with pytest.raises(InvalidBlobHash):
                    call()
                    pytest.fail(f"{what}({bad!r}) was accepted")
            assert parse_ref(BLOB_REF_PREFIX + bad) is None, bad
        assert touched == []
        assert raw.keys() == []

    def test_put_many_of_nothing(self, blob_store: BlobStore) -> None:
        assert blob_store.put_many([]) == []

    def test_unknown_blob(self, blob_store: BlobStore) -> None:
        with pytest.raises(BlobNotFound):
            blob_store.get(GOOD)
        assert blob_store.exists(GOOD) is False
        assert blob_store.info(GOOD) is None

    def test_unregistered_file_does_not_exist(self, blob_store: BlobStore, engine: Engine) -> None:
        h = blob_store.put(TEXT).hash
        with engine.begin() as conn:
            conn.execute(BlobRow.__table__.delete())  # type: ignore[attr-defined]
        assert blob_store.exists(h) is False

    # stats ------------------------------------------------------------------------------

    def test_stats_report_sizes_and_compression(self, blob_store: BlobStore) -> None:
        empty = blob_store.stats()
        assert (empty.blob_count, empty.raw_bytes, empty.stored_bytes) == (0, 0, 0)
        text, image = blob_store.put(TEXT), blob_store.put(png_like(1000))
        blob_store.put(TEXT)
        stats = blob_store.stats()
        assert stats.blob_count == 2
        assert stats.raw_bytes == len(TEXT) + image.size
        assert stats.stored_bytes == text.stored_size + image.stored_size
        assert stats.saved_by_compression == len(TEXT) - text.stored_size > 0
        assert stats.saved_by_dedup == 0  # nothing references them yet (see test_persist)


def durable_steps(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record each fsync (of a file or a directory) and rename, in order, as they happen."""
    steps: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        steps.append("fsync-dir" if Path(f"/proc/self/fd/{fd}").is_dir() else "fsync-file")
        real_fsync(fd)

    def replace(src: Any, dst: Any, *, src_dir_fd: Any = None, dst_dir_fd: Any = None) -> None:
        # beside its target: the same directory descriptor, or the same directory
        assert src_dir_fd == dst_dir_fd
        assert Path(src).parent == Path(dst).parent and Path(src).name.startswith(".tmp-")
        steps.append("rename")
        real_replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return steps


class FileDurability:
    """What only the file backend has: temporary file, fsync, rename, directory fsync."""

    def test_write_is_temp_fsync_rename_then_dir_fsync(
        self, blob_store: BlobStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        steps = durable_steps(monkeypatch)
        blob_store.put(TEXT)
        assert steps[:3] == ["fsync-file", "rename", "fsync-dir"]
        assert set(steps[3:]) <= {"fsync-dir"}  # newly created parent directories
        steps.clear()
        blob_store.put(TEXT)  # existing blob: no write at all
        assert steps == []

    def test_a_blob_in_an_existing_directory_syncs_that_directory_after_the_rename(
        self, blob_store: BlobStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The fan-out directory already exists (so it is not 'made'): its entry for the
        new file is still fsynced, after the rename (invariant 2)."""
        assert isinstance(blob_store, FileBlobStore)
        h = sha256_hex(TEXT)
        fanout = blob_store.root / h[0:2] / h[2:4]
        fanout.mkdir(parents=True)
        events: list[tuple[str, str]] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd: int) -> None:
            events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        def replace(src: Any, dst: Any, **kwargs: Any) -> None:
            events.append(("rename", str(dst)))
            real_replace(src, dst, **kwargs)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        blob_store.put(TEXT)
        renamed = [i for i, (kind, _) in enumerate(events) if kind == "rename"]
        assert renamed
        assert ("fsync", str(fanout.resolve())) in events[renamed[-1] + 1 :]

    def test_a_batch_is_written_then_synced_then_renamed_together(
        self, blob_store: BlobStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        steps = durable_steps(monkeypatch)
        items = [TEXT, png_like(), b"third" * 1000, TEXT]
        results = blob_store.put_many(items)
        assert [r.written for r in results] == [True, True, True, True]
        assert steps[:6] == ["fsync-file"] * 3 + ["rename"] * 3
        assert set(steps[6:]) == {"fsync-dir"}
        for data, result in zip(items, results, strict=True):
            assert blob_store.get(result.hash) == data

    @pytest.mark.parametrize("failing", ["write", "fsync", "replace"])
    def test_a_batch_that_fails_midway_leaves_no_temp_file_and_no_row(
        self, blob_store: BlobStore, monkeypatch: pytest.MonkeyPatch, failing: str
    ) -> None:
        """The second file's write, fsync or rename fails (disk full): the put raises the
        transient ``StorageUnavailable("blobs")``, no temporary file stays, and nothing is
        registered; a file already renamed is complete (an orphan for GC)."""
        calls: list[int] = []
        real = getattr(os, failing)

        def flaky(*args: Any, **kwargs: Any) -> Any:
            of_a_directory = failing == "fsync" and Path(f"/proc/self/fd/{args[0]}").is_dir()
            if not of_a_directory:
                calls.append(1)
                if len(calls) == 2:
                    raise OSError(28, "No space left on device")
            return real(*args, **kwargs)

        monkeypatch.setattr(os, failing, flaky)
        items = [TEXT, png_like(), b"third" * 1000]
        with pytest.raises(StorageUnavailable, match="No space left") as info:
            blob_store.put_many(items)
        assert info.value.component == "blobs"
        monkeypatch.setattr(os, failing, real)
        assert isinstance(blob_store, FileBlobStore)
        leftovers = [p for p in blob_store.root.rglob("*") if p.name.endswith(".part")]
        assert leftovers == []
        assert all(blob_store.info(sha256_hex(d)) is None for d in items)
        for path in stored_files(blob_store):  # what was renamed is whole
            h = path.name.split(".")[0]
            assert h in {sha256_hex(d) for d in items}
            assert blob_store.check_stored(h) is None

    def test_a_large_batch_fits_the_usual_descriptor_limit(self, blob_store: BlobStore) -> None:
        """600 new blobs in one put (a batch of screenshots) with 512 descriptors to spare:
        a pass holds a temporary file and the directories of at most ``FILES_PER_PASS``
        files, not of all of them at once (which failed with EMFILE, "blobs unavailable",
        on every retry)."""
        items = [os.urandom(64) + i.to_bytes(4, "big") for i in range(600)]
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 512, hard))
        try:
            results = blob_store.put_many(items)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert all(r.written for r in results)
        for data, result in zip(items, results, strict=True):
            assert blob_store.get(result.hash) == data

    def test_failed_write_leaves_no_temp_file(
        self, blob_store: BlobStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        assert isinstance(blob_store, FileBlobStore)

        def broken_replace(src: Any, dst: Any, **kwargs: Any) -> None:
            raise OSError("disk full")

        monkeypatch.setattr(os, "replace", broken_replace)
        with pytest.raises(OSError, match="disk full"):
            blob_store.put(TEXT)
        assert stored_files(blob_store) == []
        assert blob_store.info(sha256_hex(TEXT)) is None  # never registered without a file


class TestFileBlobStoreOnSQLite(BlobStoreContract, FileDurability):
    @pytest.fixture
    def url(self, sqlite_url: str) -> str:
        return sqlite_url

    @pytest.fixture
    def blob_store(self, engine: Engine, tmp_path: Path) -> BlobStore:
        return FileBlobStore(tmp_path / "blobs", BlobIndex(engine))


class TestFileBlobStoreOnPostgres(BlobStoreContract, FileDurability):
    @pytest.fixture
    def url(self, pg_url: str) -> str:
        return pg_url

    @pytest.fixture
    def blob_store(self, engine: Engine, tmp_path: Path) -> BlobStore:
        return FileBlobStore(tmp_path / "blobs", BlobIndex(engine))


class TestObjectBlobStoreOnSQLite(BlobStoreContract):
    """s3:// against moto's S3 server (real HTTP)."""

    @pytest.fixture
    def url(self, sqlite_url: str) -> str:
        return sqlite_url

    @pytest.fixture
    def blob_store(self, engine: Engine, s3_bucket: str) -> BlobStore:
        return open_blob_store(f"{s3_bucket}/blobs", engine)


class TestObjectBlobStoreOnPostgres(BlobStoreContract):
    @pytest.fixture
    def url(self, pg_url: str) -> str:
        return pg_url

    @pytest.fixture
    def blob_store(self, engine: Engine, s3_bucket: str) -> BlobStore:
        return open_blob_store(f"{s3_bucket}/blobs", engine)


def test_ref_helpers() -> None:
    assert is_valid_hash(GOOD) and not is_valid_hash(GOOD.upper()) and not is_valid_hash(None)
    assert parse_ref(make_ref(GOOD)) == GOOD
    assert parse_ref(GOOD) is None
    assert parse_ref("blob:sha256:" + GOOD + " ") is None


def test_blob_url_must_be_file_or_s3(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'j.db'}")
    try:
        store = open_blob_store((tmp_path / "b").as_uri(), engine)
        assert isinstance(store, FileBlobStore) and store.root == tmp_path / "b"
        for url in ("gs://bucket/x", "file://otherhost/x", "http://example/x"):
            with pytest.raises(BlobError):
                open_blob_store(url, engine)
    finally:
        engine.dispose()


# the incremental decoder behind ``peek`` ------------------------------------------------


def _stream(codec: Codec, stored: bytes, split: int, limit: int = 1024) -> bytes:
    decoder = StreamDecoder(codec, limit=limit)
    pieces = [*decoder.feed(stored[:split]), *decoder.feed(stored[split:])]
    decoder.finish()
    assert all(len(piece) <= limit for piece in pieces)
    return b"".join(pieces)


def test_stream_decoder_decodes_as_decode_blob_at_every_split() -> None:
    member = zlib.compress(b"hello, world " * 40, 6, wbits=31)
    for stored in (member, member + member):
        whole = decode_blob("gzip", stored)
        for split in range(len(stored) + 1):
            assert _stream("gzip", stored, split, limit=64) == whole
    assert _stream("identity", TEXT, 1000, limit=4096) == TEXT


@pytest.mark.parametrize(
    "stored",
    [b"", b"\x1f\x8b", zlib.compress(b"abc", 6, wbits=31)[:-1]],
    ids=["empty", "header-only", "truncated"],
)
def test_stream_decoder_refuses_an_incomplete_stream(stored: bytes) -> None:
    with pytest.raises(zlib.error):
        decode_blob("gzip", stored)
    decoder = StreamDecoder("gzip")
    with pytest.raises(zlib.error):
        list(decoder.feed(stored))
        decoder.finish()


def test_stream_decoder_refuses_bytes_after_the_end() -> None:
    decoder = StreamDecoder("gzip")
    with pytest.raises(zlib.error):
        list(decoder.feed(zlib.compress(b"abc", 6, wbits=31) + b"junk"))
        decoder.finish()


def test_stream_decoder_bounds_each_piece_of_a_highly_compressed_stream() -> None:
    """16 MB of zeros is 16 KB of gzip: it comes out in pieces of at most ``limit``."""
    stored = zlib.compress(bytes(16 * 1024 * 1024), 9, wbits=31)
    decoder = StreamDecoder("gzip", limit=64 * 1024)
    total = 0
    for piece in decoder.feed(stored):
        assert 0 < len(piece) <= 64 * 1024
        total += len(piece)
    decoder.finish()
    assert total == 16 * 1024 * 1024
