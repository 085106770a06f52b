"""The blob store contract (invariants 2, 6 and 9), run on each journal backend."""

from __future__ import annotations

import gzip
import os
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from core.blobs.store import (
    BLOB_REF_PREFIX,
    BlobIndex,
    BlobStore,
    FileBlobStore,
    encode_blob,
    is_valid_hash,
    make_ref,
    open_blob_store,
    parse_ref,
    sha256_hex,
)
from core.db import make_engine
from core.errors import BlobCorrupted, BlobError, BlobNotFound, InvalidBlobHash
from core.models import BlobRow

PNG = b"\x89PNG\r\n\x1a\n"
TEXT = b"".join(b"line %d: the quick brown fox jumps over the lazy dog\n" % i for i in range(2000))
GOOD = sha256_hex(b"x")
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

    def test_file_layout_and_gzip_encoding(self, blob_store: BlobStore) -> None:
        assert isinstance(blob_store, FileBlobStore)
        text, image = blob_store.put(TEXT), blob_store.put(png_like())
        h = text.hash
        gz = blob_store.root / h[0:2] / h[2:4] / f"{h}.blob.gz"
        assert gz.is_file()
        assert gzip.decompress(gz.read_bytes()) == TEXT
        assert text.stored_size == gz.stat().st_size < len(TEXT)
        h = image.hash
        assert (blob_store.root / h[0:2] / h[2:4] / f"{h}.blob").is_file()
        assert stored_files(blob_store) == sorted(
            [gz, blob_store.root / h[0:2] / h[2:4] / f"{h}.blob"]
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

    def test_identical_content_is_one_blob(self, blob_store: BlobStore) -> None:
        assert isinstance(blob_store, FileBlobStore)
        first = blob_store.put(TEXT)
        again = blob_store.put_many([TEXT, TEXT, b"other"])
        assert [r.hash for r in again] == [first.hash, first.hash, sha256_hex(b"other")]
        assert [r.written for r in again] == [False, False, True]
        assert len(stored_files(blob_store)) == 2
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
        real_stage = blob_store._stage

        def stage_then_gc(blob_hash: str, data: bytes) -> Any:
            staged = real_stage(blob_hash, data)
            blob_store.remove_file(blob_hash)  # GC wins the race before the row lock
            return staged

        monkeypatch.setattr(blob_store, "_stage", stage_then_gc)
        result = blob_store.put(TEXT)
        assert result.written is True
        assert blob_store.get(h) == TEXT
        info = blob_store.info(h)
        assert info is not None and info.stored_size == result.stored_size

    def test_remove_file_and_iter_files(self, blob_store: BlobStore) -> None:
        assert isinstance(blob_store, FileBlobStore)
        assert list(blob_store.iter_files()) == []
        a, b = blob_store.put(TEXT), blob_store.put(png_like())
        junk = blob_store.root / a.hash[0:2] / a.hash[2:4] / ".tmp-leftover.part"
        junk.write_bytes(b"partial")
        (blob_store.root / "README").write_text("not a blob")
        files = {f.hash: f for f in blob_store.iter_files()}
        assert set(files) == {a.hash, b.hash}
        assert (files[a.hash].codec, files[b.hash].codec) == ("gzip", "identity")
        assert files[a.hash].stored_size == a.stored_size
        assert blob_store.remove_file(a.hash) is True
        assert blob_store.remove_file(a.hash) is False
        assert {f.hash for f in blob_store.iter_files()} == {b.hash}
        with pytest.raises(BlobNotFound):
            blob_store.get(a.hash)

    # durability ---------------------------------------------------------------------------

    def test_write_is_temp_fsync_rename_then_dir_fsync(
        self, blob_store: BlobStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        steps: list[str] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd: int) -> None:
            steps.append("fsync-dir" if Path(f"/proc/self/fd/{fd}").is_dir() else "fsync-file")
            real_fsync(fd)

        def replace(src: Any, dst: Any) -> None:
            assert Path(src).parent == Path(dst).parent and Path(src).name.startswith(".tmp-")
            steps.append("rename")
            real_replace(src, dst)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        blob_store.put(TEXT)
        assert steps[:3] == ["fsync-file", "rename", "fsync-dir"]
        assert set(steps[3:]) <= {"fsync-dir"}  # newly created parent directories
        steps.clear()
        blob_store.put(TEXT)  # existing blob: no write at all
        assert steps == []

    def test_failed_write_leaves_no_temp_file(
        self, blob_store: BlobStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        assert isinstance(blob_store, FileBlobStore)

        def broken_replace(src: Any, dst: Any) -> None:
            raise OSError("disk full")

        monkeypatch.setattr(os, "replace", broken_replace)
        with pytest.raises(OSError, match="disk full"):
            blob_store.put(TEXT)
        assert stored_files(blob_store) == []
        assert blob_store.info(sha256_hex(TEXT)) is None  # never registered without a file

    # corruption -------------------------------------------------------------------------

    @pytest.mark.parametrize("data", [TEXT, png_like()], ids=["gzip", "identity"])
    def test_flipped_bytes_are_detected(self, blob_store: BlobStore, data: bytes) -> None:
        assert isinstance(blob_store, FileBlobStore)
        h = blob_store.put(data).hash
        [path] = stored_files(blob_store)
        good = path.read_bytes()
        for where in (0, len(good) // 2, len(good) - 1):
            raw = bytearray(good)
            raw[where] ^= 0xFF
            path.write_bytes(bytes(raw))
            with pytest.raises(BlobCorrupted) as caught:
                blob_store.get(h)
            assert caught.value.blob_hash == h
        path.write_bytes(good)
        assert blob_store.get(h) == data

    def test_truncated_and_substituted_files_are_detected(self, blob_store: BlobStore) -> None:
        assert isinstance(blob_store, FileBlobStore)
        h = blob_store.put(TEXT).hash
        path = blob_store.path_for(h, "gzip")
        path.write_bytes(path.read_bytes()[:-40])
        with pytest.raises(BlobCorrupted):
            blob_store.get(h)
        path.write_bytes(zlib.compress(b"some other content", 6, wbits=31))
        with pytest.raises(BlobCorrupted, match="does not match its hash"):
            blob_store.get(h)

    # invariant 9: hashes are validated before any path is built -------------------------

    def test_bad_hashes_never_reach_the_filesystem(
        self, blob_store: BlobStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        assert isinstance(blob_store, FileBlobStore)
        touched: list[str] = []
        for name in ("_find", "_read", "_write"):
            monkeypatch.setattr(blob_store, name, lambda *a, n=name: touched.append(n))
        for bad in BAD_HASHES:
            calls = {
                "get": lambda: blob_store.get(bad),  # noqa: B023
                "exists": lambda: blob_store.exists(bad),  # noqa: B023
                "info": lambda: blob_store.info(bad),  # noqa: B023
                "remove_file": lambda: blob_store.remove_file(bad),  # noqa: B023
                "refresh": lambda: blob_store.refresh([GOOD, bad]),  # noqa: B023
                "path_for": lambda: blob_store.path_for(bad, "gzip"),  # noqa: B023
                "make_ref": lambda: make_ref(bad),  # noqa: B023
            }
            for what, call in calls.items():
                with pytest.raises(InvalidBlobHash):
                    call()
                    pytest.fail(f"{what}({bad!r}) was accepted")
            assert parse_ref(BLOB_REF_PREFIX + bad) is None, bad
        assert touched == []
        assert not blob_store.root.exists()

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


class TestFileBlobStoreOnSQLite(BlobStoreContract):
    @pytest.fixture
    def url(self, sqlite_url: str) -> str:
        return sqlite_url

    @pytest.fixture
    def blob_store(self, engine: Engine, tmp_path: Path) -> BlobStore:
        return FileBlobStore(tmp_path / "blobs", BlobIndex(engine))


class TestFileBlobStoreOnPostgres(BlobStoreContract):
    @pytest.fixture
    def url(self, pg_url: str) -> str:
        return pg_url

    @pytest.fixture
    def blob_store(self, engine: Engine, tmp_path: Path) -> BlobStore:
        return FileBlobStore(tmp_path / "blobs", BlobIndex(engine))


def test_ref_helpers() -> None:
    assert is_valid_hash(GOOD) and not is_valid_hash(GOOD.upper()) and not is_valid_hash(None)
    assert parse_ref(make_ref(GOOD)) == GOOD
    assert parse_ref(GOOD) is None
    assert parse_ref("blob:sha256:" + GOOD + " ") is None


def test_blob_url_must_be_file(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'j.db'}")
    try:
        store = open_blob_store((tmp_path / "b").as_uri(), engine)
        assert isinstance(store, FileBlobStore) and store.root == tmp_path / "b"
        for url in ("s3://bucket/x", "file://otherhost/x"):
            with pytest.raises(BlobError):
                open_blob_store(url, engine)
    finally:
        engine.dispose()
