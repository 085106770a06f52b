"""Blobs on S3 when the object store misbehaves (issue 20, "fault tests on S3").

Real S3 HTTP APIs only: moto's server mode. The shared ``s3_endpoint`` serves the corrupt-
object tests; the outage test starts a moto server of its own, so it can stop it in the
middle of a stream of writes that a real ``celery worker`` process is committing, and start
it again on the same port.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import obstore
import pytest

from core import SessionStore, Settings
from core.blobs.objects import ObjectBlobStore
from core.blobs.verify import verify_blobs
from core.errors import BlobCorrupted
from tasks import enqueue_append
from tasks.app import create_app
from tests.support import WorkerProcess, free_port, settings_env, wait_for

TEXT = b"".join(b"line %d: the quick brown fox\n" % i for i in range(3000))  # gzip codec
MEDIA = b"\x89PNG\r\n\x1a\n" + os.urandom(20_000)  # identity codec
DAMAGE: dict[str, Callable[[bytes], bytes]] = {
    "truncate": lambda data: data[: len(data) // 2],
    "flip": lambda data: (
        data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0x01]) + data[len(data) // 2 + 1 :]
    ),
}


def _object_key(store: SessionStore, blob_hash: str) -> str:
    blobs = store.blobs
    assert isinstance(blobs, ObjectBlobStore)
    for codec in ("gzip", "identity"):
        key = blobs.key_for(blob_hash, codec)  # type: ignore[arg-type]
        try:
            obstore.head(blobs.store, key)
        except FileNotFoundError:
            continue
        return key
    raise AssertionError(f"no object for {blob_hash}")


def _damage_object(store: SessionStore, blob_hash: str, damage: str) -> None:
    """Overwrite the stored object through the S3 API, as a faulty disk or client would."""
    blobs = store.blobs
    assert isinstance(blobs, ObjectBlobStore)
    key = _object_key(store, blob_hash)
    data = obstore.get(blobs.store, key).bytes().to_bytes()
    obstore.put(blobs.store, key, DAMAGE[damage](data))


@pytest.mark.parametrize("content", [TEXT, MEDIA], ids=["gzip", "identity"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_corrupt_object_is_never_served_and_a_re_put_or_verify_deals_with_it(
    s3_store: SessionStore, damage: str, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    store = s3_store
    blob_hash = store.blobs.put(content).hash
    _damage_object(store, blob_hash, damage)

    with pytest.raises(BlobCorrupted):
        store.blobs.get(blob_hash)

    # A rehydrating read keeps the ref and warns, as for a missing blob.
    sid = store.create_session(tenant_id="acme").id
    store.append(sid, [{"type": "custom", "data": TEXT.decode() * 3}])
    [raw] = store.read(sid)
    ref = raw.payload["data"]
    ref_hash = ref.rsplit(":", 1)[1]
    _damage_object(store, ref_hash, damage)
    with caplog.at_level(logging.WARNING):
        [event] = store.read(sid, rehydrate=True)
    assert event.payload["data"] == ref
    assert any(r.__dict__.get("blob_hash") == ref_hash for r in caplog.records)

    again = store.blobs.put(content)  # verifies the stored object and replaces it
    assert again.written
    assert store.blobs.get(blob_hash) == content

    _damage_object(store, blob_hash, damage)  # the event's blob is still damaged too
    report = verify_blobs(store.blobs)
    assert report.corrupt == sorted({blob_hash, ref_hash}) and report.missing == []
    assert len(report.quarantined) == 2
    assert not report.healthy
    assert verify_blobs(store.blobs).missing == sorted({blob_hash, ref_hash})  # never served


# --- the endpoint stopped mid-write ------------------------------------------------------------


class MotoOnPort:
    """A moto S3 server on a fixed port, stoppable and restartable. moto keeps its buckets
    in the process, so a restarted server still has every object the stopped one took."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server: object | None = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        server.start()
        self._server = server

    def stop(self) -> None:
        server = self._server
        if server is not None:
            server.stop()  # type: ignore[attr-defined]
            self._server = None


def _png(i: int) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + hashlib.sha256(b"%d" % i).digest() * 700


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.redis
def test_the_s3_endpoint_stopped_mid_stream_loses_no_write_and_leaves_no_dangling_ref(
    pg_url: str, redis_url: str, s3_endpoint: str, tmp_path: Path
) -> None:
    moto = MotoOnPort()
    moto.start()
    bucket = "outage"
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{moto.endpoint}/{bucket}", method="PUT"))
    blob_url = f"s3://{bucket}/blobs"
    settings = Settings(
        data_dir=tmp_path / "data",
        database_url=pg_url,
        broker_url=redis_url,
        result_backend=redis_url,
        blob_url=blob_url,
    )
    env = {
        **settings_env(database_url=pg_url, broker_url=redis_url, data_dir=tmp_path / "w"),
        "SESSIONSTORE_BLOB_URL": blob_url,
        "AWS_ENDPOINT_URL": moto.endpoint,
        # obstore's own retries would ride out a 3 s outage inside one call: a short retry
        # window makes the outage reach the task, whose retry is what this test is about.
        "SESSIONSTORE_S3_RETRY_SECONDS": "0.5",
    }
    saved = os.environ.get("AWS_ENDPOINT_URL")
    os.environ["AWS_ENDPOINT_URL"] = moto.endpoint  # this process's store reads it too
    worker = WorkerProcess(env, tmp_path / "worker.log")
    app = create_app(settings)
    try:
        with SessionStore.from_settings(settings) as store:
            sid = store.create_session(tenant_id="acme").id
            images = {f"w{i}": _png(i) for i in range(60)}
            handles = []
            for i, (key, png) in enumerate(images.items()):
                event = {"type": "custom", "marker": key, "image": base64.b64encode(png).decode()}
                handles.append(enqueue_append(sid, [event], idempotency_key=key, app=app))
                if i == 15:
                    wait_for(lambda: len(store.read(sid)) >= 3, 60, "writes before the outage")
                    moto.stop()  # the object store goes away mid-stream
                if i == 40:
                    time.sleep(3)  # writes are failing and being retried meanwhile
                    moto.start()
            results = [h.get(timeout=180) for h in handles]
            assert sorted(r.last_seq for r in results) == list(range(1, 61))

            events = store.read(sid, rehydrate=True)
            got = {e.payload["marker"]: base64.b64decode(e.payload["image"]) for e in events}
            assert got == images  # every write, every image byte-identical
            assert len(events) == 60  # once each
            blobs = store.blobs
            assert isinstance(blobs, ObjectBlobStore)
            refs = {str(e.payload["image"]) for e in store.read(sid)}  # as journaled
            assert len(refs) == 60 and all(r.startswith("blob:sha256:") for r in refs), refs
            for ref in refs:
                assert blobs.get(ref.rsplit(":", 1)[1]) is not None  # no ref without object
            assert verify_blobs(blobs).healthy
    finally:
        app.close()
        worker.stop()
        moto.stop()
        if saved is None:
            os.environ.pop("AWS_ENDPOINT_URL", None)
        else:
            os.environ["AWS_ENDPOINT_URL"] = saved
    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert "StorageUnavailable" in log or "retry" in log.lower(), "the outage was never felt"


def test_an_s3_endpoint_that_never_answers_fails_a_put_within_the_configured_limits(
    black_hole: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """obstore's defaults hold a call to a silent endpoint for 30 s per attempt, retried for
    3 minutes; SESSIONSTORE_S3_REQUEST_TIMEOUT_SECONDS and _RETRY_SECONDS bound it."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", black_hole)
    settings = Settings(
        data_dir=tmp_path,
        blob_url="s3://hung/blobs",
        artifact_url="s3://hung/artifacts",
        s3_request_timeout_seconds=1.0,
        s3_retry_seconds=1.0,
    )
    from core.artifacts.storage import artifact_storage_for
    from core.blobs.backends import blob_store_for
    from core.db import make_engine
    from core.errors import StorageUnavailable
    from core.migrate import upgrade

    upgrade(settings.resolved_database_url)
    engine = make_engine(settings.resolved_database_url)
    try:
        for call in (
            lambda: blob_store_for(settings, engine).put(b"x" * 100),
            lambda: artifact_storage_for(settings).probe(),
        ):
            started = time.monotonic()
            with pytest.raises(StorageUnavailable):
                call()
            # one timed-out attempt, then retries until the 1 s window is spent
            assert time.monotonic() - started < 6
    finally:
        engine.dispose()


def test_a_missing_bucket_is_storage_unavailable_not_lost_blobs(
    s3_bucket: str, tmp_path: Path
) -> None:
    """A bucket deleted, or mistyped in SESSIONSTORE_BLOB_URL: S3 answers 404 as for a
    missing object, and it was taken for one. Every stored blob read as lost
    (``BlobNotFound``; a rehydrating read quietly kept its refs), and every write failed
    with a bare ``FileNotFoundError``: bad input to the CLI, a dead letter to the queue.
    Now it is ``StorageUnavailable`` naming the bucket, which the queue retries."""
    from core.errors import StorageUnavailable
    from tasks.retry import is_transient

    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    settings = Settings(data_dir=tmp_path / "d", database_url=journal, blob_url=f"{s3_bucket}/b")
    with SessionStore.from_settings(settings) as store:
        sid = store.create_session(tenant_id="acme").id
        store.append(sid, [{"type": "custom", "data": TEXT.decode()}])
        stored = store.blobs.put(TEXT).hash
    typo = settings.with_overrides(blob_url=f"{s3_bucket}-typo/b")
    with SessionStore.from_settings(typo) as store:
        calls: list[Callable[[], object]] = [
            lambda: store.blobs.get(stored),
            lambda: store.read(sid, rehydrate=True),
            lambda: store.blobs.put(b"new content " * 100),
            lambda: store.append(sid, [{"type": "custom", "data": MEDIA.hex()}]),
        ]
        for call in calls:
            with pytest.raises(StorageUnavailable, match="typo does not exist") as away:
                call()
            assert away.value.component == "blobs" and is_transient(away.value)
