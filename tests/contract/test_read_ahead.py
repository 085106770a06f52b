"""Read-ahead: an exact rehydration from S3 keeps several blob reads in flight.

A read from S3 is a round trip, so the blobs of a session are read concurrently, up to the
store's ``read_ahead``, ahead of the one being decoded (``core.blobs.rehydrate._ReadAhead``).
What must hold all the same: every value exact; a missing or corrupt blob keeps its ref and
is logged where it is, as without read-ahead; a storage failure leaves no read running once
the call has raised; memory bounded by the window and by a byte budget; and a forked worker
process (Celery's prefork pool) gets threads of its own instead of hanging on its parent's.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import obstore
import pytest

from core import SessionStore
from core.blobs import rehydrate
from core.blobs.objects import ObjectBlobStore
from core.blobs.rehydrate import READ_AHEAD_THREADS, Rehydrator, _ReadAhead
from core.blobs.store import make_ref, sha256_hex
from core.errors import StorageUnavailable

N = 12  # more than READ_AHEAD_THREADS: the pool's every thread is used


def text(i: int) -> str:
    return f"output {i}: " + "x" * 20_000


def events() -> list[dict[str, Any]]:
    return [
        {"type": "message", "message": {"role": "toolResult", "content": [text(i)]}}
        for i in range(N)
    ]


@pytest.fixture
def filled(s3_store: SessionStore) -> str:
    session = s3_store.create_session(tenant_id="acme")
    s3_store.append(session.id, events())
    return session.id


class InFlight:
    """Wraps ``get``: counts the calls running at once, each held ``hold`` seconds."""

    def __init__(self, get: Callable[[str], bytes], hold: float = 0.02) -> None:
        self.get = get
        self.hold = hold
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.calls: list[str] = []

    def __call__(self, blob_hash: str) -> bytes:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
            self.calls.append(blob_hash)
        try:
            time.sleep(self.hold)
            return self.get(blob_hash)
        finally:
            with self.lock:
                self.now -= 1


def fresh_reader(store: SessionStore) -> None:
    """Forget the values this process verified, so that every blob is read again."""
    store._rehydrator = Rehydrator(store.blobs)


def test_s3_reads_overlap_within_the_window_and_every_value_is_exact(
    s3_store: SessionStore, filled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert isinstance(s3_store.blobs, ObjectBlobStore) and s3_store.blobs.read_ahead > 1
    fresh_reader(s3_store)
    gets = InFlight(s3_store.blobs.get)
    monkeypatch.setattr(s3_store.blobs, "get", gets)
    read = s3_store.read(filled, rehydrate=True)
    assert [e.payload for e in read] == events()
    assert 2 <= gets.most <= s3_store.blobs.read_ahead
    assert sorted(gets.calls) == sorted(sha256_hex(text(i).encode()) for i in range(N))
    assert gets.now == 0


def test_a_file_store_reads_one_blob_at_a_time(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured: threads made a local rehydration slower (bench/RESULTS.md)."""
    session = store.create_session(tenant_id="acme")
    store.append(session.id, events())
    fresh_reader(store)
    gets = InFlight(store.blobs.get, hold=0.005)
    monkeypatch.setattr(store.blobs, "get", gets)
    assert [e.payload for e in store.read(session.id, rehydrate=True)] == events()
    assert gets.most == 1 and len(gets.calls) == N


def test_a_missing_and_a_corrupt_blob_among_them_keep_their_refs(
    s3_store: SessionStore, filled: str, caplog: pytest.LogCaptureFixture
) -> None:
    blobs = s3_store.blobs
    assert isinstance(blobs, ObjectBlobStore)
    gone, damaged = sha256_hex(text(3).encode()), sha256_hex(text(7).encode())
    [gone_key] = [k for k in _keys(blobs) if gone in k]
    [damaged_key] = [k for k in _keys(blobs) if damaged in k]
    obstore.delete(blobs.store, gone_key)
    obstore.put(blobs.store, damaged_key, b"not the blob")
    fresh_reader(s3_store)
    with caplog.at_level(logging.WARNING, logger="core.blobs.rehydrate"):
        read = s3_store.read(filled, rehydrate=True)
    expected = events()
    for i in (3, 7):
        expected[i]["message"]["content"][0] = make_ref(sha256_hex(text(i).encode()))
    assert [e.payload for e in read] == expected
    logged = {
        tuple(getattr(r, name, None) for name in ("blob_hash", "seq", "pointer", "levelno"))
        for r in caplog.records
    }
    assert (gone, 4, "/message/content/0", logging.WARNING) in logged
    assert (damaged, 8, "/message/content/0", logging.ERROR) in logged


def _keys(blobs: ObjectBlobStore) -> list[str]:
    return [meta["path"] for batch in obstore.list(blobs.store) for meta in batch]


def test_a_storage_failure_raises_and_leaves_no_read_running(
    s3_store: SessionStore, filled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh_reader(s3_store)
    real = s3_store.blobs.get
    failing = sha256_hex(text(2).encode())

    def get(blob_hash: str) -> bytes:
        if blob_hash == failing:
            raise StorageUnavailable("blobs", "connection reset")
        return real(blob_hash)

    gets = InFlight(get, hold=0.1)
    monkeypatch.setattr(s3_store.blobs, "get", gets)
    with pytest.raises(StorageUnavailable):
        s3_store.read(filled, rehydrate=True)
    assert gets.now == 0  # nothing still reading after the call
    assert gets.most >= 2


# the read-ahead itself ----------------------------------------------------------------


class Gated:
    """A ``get`` whose calls wait for the test's go-ahead, to see what has been started."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.go = threading.Event()

    def __call__(self, blob_hash: str) -> bytes:
        self.started.append(blob_hash)
        assert self.go.wait(10)
        return blob_hash.encode()


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_no_more_than_the_window_is_started_ahead() -> None:
    gated = Gated()
    ahead = _ReadAhead(gated, [f"h{i}" for i in range(10)], window=3)
    asking = threading.Thread(target=ahead.get, args=("h0",))
    asking.start()
    _until(lambda: len(gated.started) >= 3)
    time.sleep(0.05)  # room for a fourth, were one started
    assert sorted(gated.started) == ["h0", "h1", "h2"]
    gated.go.set()
    asking.join(10)
    assert ahead.get("h1") == b"h1"
    ahead.close()


def test_answers_out_of_order_again_and_skipped_ones() -> None:
    calls: list[str] = []

    def get(blob_hash: str) -> bytes:
        calls.append(blob_hash)
        return blob_hash.encode()

    hashes = [f"h{i}" for i in range(8)]
    ahead = _ReadAhead(get, hashes, window=2)
    assert ahead.get("h0") == b"h0"
    assert ahead.get("h5") == b"h5"  # h1-h4 passed over (a cached value, a bad pointer)
    assert ahead.get("h0") == b"h0"  # asked again: read again
    assert ahead.get("h6") == b"h6"
    assert ahead.get("h7") == b"h7"
    assert ahead.get("elsewhere") == b"elsewhere"  # not planned: read in the caller's thread
    ahead.close()
    # a window of 2 started h1 ahead of h0 (it may have been cancelled before it ran);
    # h2-h4 were never started, and nothing but h0 was read twice
    assert not {"h2", "h3", "h4"} & set(calls)
    assert sorted(c for c in calls if c != "h1") == ["elsewhere", "h0", "h0", "h5", "h6", "h7"]


def _read_ahead_in_child(out: Any) -> None:
    ahead = _ReadAhead(lambda h: h.encode(), [f"c{i}" for i in range(N)], window=N)
    out.put([ahead.get(f"c{i}") for i in range(N)])
    ahead.close()


def test_a_forked_process_reads_ahead_with_threads_of_its_own() -> None:
    """Celery's prefork pool forks a worker process from one whose pool may be full."""
    gated = Gated()
    ahead = _ReadAhead(gated, [f"p{i}" for i in range(N)], window=N)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend(ahead.get(f"p{i}") for i in range(N)))
    reader.start()
    _until(lambda: len(gated.started) >= READ_AHEAD_THREADS)  # every thread of the pool, busy
    gated.go.set()
    reader.join(10)
    ahead.close()
    assert got == [f"p{i}".encode() for i in range(N)]
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_read_ahead_in_child, args=(out,))
    child.start()
    try:
        assert out.get(timeout=20) == [f"c{i}".encode() for i in range(N)]
    finally:
        child.join(20)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


class PerHash:
    """A ``get`` whose call for each hash waits for that hash's release; counts the calls
    running at once."""

    def __init__(self) -> None:
        self.released: dict[str, threading.Event] = {}
        self.started: list[str] = []
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0

    def gate(self, blob_hash: str) -> threading.Event:
        with self.lock:
            return self.released.setdefault(blob_hash, threading.Event())

    def release(self, *hashes: str) -> None:
        for h in hashes:
            self.gate(h).set()

    def release_all(self) -> None:
        with self.lock:
            gates = list(self.released.values())
        for gate in gates:
            gate.set()

    def __call__(self, blob_hash: str) -> bytes:
        with self.lock:
            self.started.append(blob_hash)
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            assert self.gate(blob_hash).wait(10)
            return blob_hash.encode()
        finally:
            with self.lock:
                self.now -= 1


def test_reads_passed_over_while_running_still_count_against_the_window() -> None:
    reads = PerHash()
    ahead = _ReadAhead(reads, [f"h{i}" for i in range(10)], window=3)
    got: list[bytes] = []
    caller = threading.Thread(target=lambda: got.extend([ahead.get("h0"), ahead.get("h5")]))
    caller.start()
    try:
        _until(lambda: {"h0", "h1", "h2"} <= set(reads.started))
        reads.release("h0")  # the caller goes on to h5, passing h1 and h2, still running
        _until(lambda: "h5" in reads.started)
        time.sleep(0.05)  # room for more reads, were they started
        assert reads.most <= 3, reads.started
    finally:
        reads.release_all()
        caller.join(10)
    ahead.close()
    assert got == [b"h0", b"h5"]
    assert reads.now == 0


class Interrupt(BaseException):
    """What a Celery soft time limit or a ^C raises in the thread that waits."""


def test_an_interrupt_while_waiting_leaves_no_read_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads = PerHash()
    ahead = _ReadAhead(reads, ["h0", "h1", "h2", "h3"], window=4)
    reads.release("h0")
    assert ahead.get("h0") == b"h0"  # read by the caller; h1-h3 started in the pool
    _until(lambda: {"h1", "h2", "h3"} <= set(reads.started))

    def interrupted(self: Future[bytes], timeout: float | None = None) -> bytes:
        raise Interrupt

    monkeypatch.setattr(Future, "result", interrupted)
    with pytest.raises(Interrupt):
        ahead.get("h1")
    monkeypatch.undo()
    threading.Timer(0.3, reads.release, args=("h2", "h3")).start()
    threading.Timer(0.6, reads.release, args=("h1",)).start()  # the interrupted one, last
    ahead.close()
    assert reads.now == 0  # close waited for h1 as well


def test_a_read_queued_behind_other_rehydrations_is_done_by_its_caller() -> None:
    """The pool is shared: a small rehydration never waits behind a big one's reads."""
    reads = PerHash()
    big = _ReadAhead(reads, [f"b{i}" for i in range(READ_AHEAD_THREADS + 1)], window=99)
    big_caller = threading.Thread(target=big.get, args=("b0",))
    big_caller.start()  # b0 in that thread, b1-b8 hold every thread of the pool
    small = _ReadAhead(lambda h: h.encode(), ["q0", "q1", "q2"], window=3)
    got: list[bytes] = []
    small_caller = threading.Thread(target=lambda: got.extend(small.get(h) for h in small._hashes))
    try:
        _until(lambda: len(reads.started) == READ_AHEAD_THREADS + 1)
        small_caller.start()
        small_caller.join(5)
        assert not small_caller.is_alive(), "the small read waited for the big one's"
        assert got == [b"q0", b"q1", b"q2"]
    finally:
        reads.release_all()
        big_caller.join(10)
        small_caller.join(10)
    small.close()
    big.close()


def test_without_threads_it_reads_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class NoThreads:
        def submit(self, *args: Any) -> Future[bytes]:
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(rehydrate, "_pool", NoThreads)
    hashes = [f"h{i}" for i in range(5)]
    ahead = _ReadAhead(lambda h: h.encode(), hashes, window=4)
    with caplog.at_level(logging.WARNING, logger="core.blobs.rehydrate"):
        assert [ahead.get(h) for h in hashes] == [h.encode() for h in hashes]
    ahead.close()
    assert "read-ahead unavailable" in caplog.text


def test_the_bytes_read_ahead_stay_within_the_budget() -> None:
    """Blobs of up to ``max_blob_bytes`` would let a window of reads hold that many times
    as much: reads ahead stop at ``max_bytes``, and one larger than that alone is read
    only when asked for, in the caller's thread."""
    gated = Gated()
    sizes = [40, 40, 40, 40, 500, 10, 10]
    hashes = [f"h{i}" for i in range(len(sizes))]
    ahead = _ReadAhead(gated, hashes, window=8, sizes=sizes, max_bytes=100)
    asking = threading.Thread(target=ahead.get, args=("h0",))
    asking.start()
    _until(lambda: len(gated.started) >= 3)
    time.sleep(0.05)  # room for a fourth, were one started
    assert sorted(gated.started) == ["h0", "h1", "h2"]  # h0 read by its caller; 80 ahead
    gated.go.set()
    asking.join(10)
    readers: dict[str, str] = {}

    def get(blob_hash: str) -> bytes:
        readers[blob_hash] = threading.current_thread().name
        time.sleep(0.02)  # long enough for the pool to take up what was started
        return blob_hash.encode()

    ahead.close()
    ahead = _ReadAhead(get, hashes, window=8, sizes=sizes, max_bytes=100)
    assert [ahead.get(h) for h in hashes] == [h.encode() for h in hashes]
    ahead.close()
    assert readers["h4"] == threading.current_thread().name  # too large to read ahead
    assert any(readers[h] != threading.current_thread().name for h in ("h5", "h6"))


def test_an_s3_rehydration_reads_ahead_within_the_byte_budget(
    s3_store: SessionStore, filled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget is the manifest's sizes: blobs of 20 KB with 25 KB to read ahead leave
    one read ahead of the caller's, whatever the window."""
    assert s3_store.blobs.read_ahead > 2
    monkeypatch.setattr(rehydrate, "READ_AHEAD_BYTES", 25_000)
    fresh_reader(s3_store)
    gets = InFlight(s3_store.blobs.get)
    monkeypatch.setattr(s3_store.blobs, "get", gets)
    assert [e.payload for e in s3_store.read(filled, rehydrate=True)] == events()
    assert gets.most == 2 and len(gets.calls) == N
