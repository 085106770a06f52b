"""Eight processes put the same blob: one file, one row, and no reader sees a partial file;
``blobs verify`` against a put that repairs the file it is checking."""

from __future__ import annotations

import multiprocessing
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from core.blobs.files import FileBlobStore
from core.blobs.store import BlobIndex, PutResult, sha256_hex
from core.blobs.verify import verify_blobs
from core.db import make_engine
from core.errors import BlobNotFound

MP = multiprocessing.get_context("spawn")
WRITERS = 8
PNG = b"\x89PNG\r\n\x1a\n"
SIZE = 12 * 1024 * 1024  # large enough that a non-atomic write would be seen half-done


def blob_bytes(seed: int) -> bytes:
    return PNG + random.Random(seed).randbytes(SIZE)


def _put(url: str, root: str, seed: int, start: Any, results: Any) -> None:
    engine = make_engine(url, pool_size=1)
    try:
        store = FileBlobStore(Path(root), BlobIndex(engine))
        data = blob_bytes(seed)
        start.wait()
        results.put(store.put(data))
    finally:
        engine.dispose()


class Reader(threading.Thread):
    """Reads the blob (file and API) over and over while the writers race."""

    def __init__(self, store: FileBlobStore, blob_hash: str, expected: bytes) -> None:
        super().__init__(daemon=True)
        self.store, self.hash, self.expected = store, blob_hash, expected
        self.path = store.path_for(blob_hash, "identity")
        self.stop = threading.Event()
        self.full_reads = 0
        self.problems: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            self.read_file()
            self.read_api()

    def read_file(self) -> None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        if raw != self.expected:
            self.problems.append(f"file had {len(raw)} of {len(self.expected)} bytes")
        else:
            self.full_reads += 1

    def read_api(self) -> None:
        try:
            if self.store.get(self.hash) != self.expected:
                self.problems.append("get returned other bytes")
        except BlobNotFound:
            pass
        except Exception as exc:  # BlobCorrupted would mean a partial file was visible
            self.problems.append(repr(exc))


@pytest.mark.slow
def test_eight_processes_put_the_same_blob(database_url: str, tmp_path: Path) -> None:
    root = tmp_path / "blobs"
    data = blob_bytes(7)
    blob_hash = sha256_hex(data)
    engine = make_engine(database_url)
    store = FileBlobStore(root, BlobIndex(engine))
    reader = Reader(store, blob_hash, data)
    start, results = MP.Event(), MP.Queue()
    procs = [
        MP.Process(target=_put, args=(database_url, str(root), 7, start, results))
        for _ in range(WRITERS)
    ]
    try:
        for p in procs:
            p.start()
        reader.start()
        start.set()
        got: list[PutResult] = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        reader.read_file()  # at least one read after every writer finished
        reader.stop.set()
        reader.join(timeout=60)
        stats = store.stats()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        engine.dispose()

    assert [p.exitcode for p in procs] == [0] * WRITERS
    assert {r.hash for r in got} == {blob_hash}
    assert any(r.written for r in got)
    assert reader.problems == []
    assert reader.full_reads > 0
    files = [p for p in root.rglob("*") if p.is_file()]
    assert files == [reader.path]  # one file, no temporary leftovers
    assert (stats.blob_count, stats.raw_bytes) == (1, len(data))


def test_verify_leaves_a_file_a_concurrent_put_repaired(database_url: str, tmp_path: Path) -> None:
    """verify finds a blob corrupt; before it moves the file, another process's put of the
    content repairs it. verify re-checks under the row's lock and leaves the good file: the
    blob stays readable and nothing is quarantined. (The interleaving is forced: the put
    runs right after verify's first check, through a store of its own.)"""
    engine = make_engine(database_url)
    writer = FileBlobStore(tmp_path / "blobs", BlobIndex(engine))
    verifier = FileBlobStore(tmp_path / "blobs", BlobIndex(engine))
    content = b"important tool output\n" * 500
    result = writer.put(content)
    path = writer.path_for(result.hash, result.codec)
    damaged = bytearray(path.read_bytes())
    damaged[-9] ^= 0xFF
    path.write_bytes(bytes(damaged))
    first_check = verifier.check_stored
    repairs: list[bool] = []

    def check_then_a_put_repairs(blob_hash: str, size: int | None = None) -> str | None:
        problem = first_check(blob_hash, size)
        if not repairs:
            repairs.append(writer.put(content).written)
        return problem

    verifier.check_stored = check_then_a_put_repairs  # type: ignore[method-assign]
    try:
        report = verify_blobs(verifier)
        assert repairs == [True]
        assert report.quarantined == [] and report.corrupt == [] and report.healthy
        assert writer.get(result.hash) == content
    finally:
        engine.dispose()
