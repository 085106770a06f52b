"""Two machines: two real ``celery worker`` processes with their own data directory and
HOME, sharing only PostgreSQL, Redis and the S3 endpoint (moto server; blobs and artifacts
both on S3). What one wrote the other serves, and neither keeps anything but caches.

The workers run one after the other for the steps that must happen on "the other
machine" (a write on A, its rehydrate on B), so which one took a task is never a guess.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core import SessionStore, Settings
from tasks import enqueue_append, enqueue_rehydrate
from tasks.app import create_app
from tasks.runtime import attach_fork_copier
from tests.support import WorkerProcess, settings_env, wait_for

PNG = b"\x89PNG\r\n\x1a\n"
AWS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ALLOW_HTTP")


def _entries(turn: int, parent: str | None) -> list[dict[str, Any]]:
    image = base64.b64encode(PNG + hashlib.sha256(f"{turn}".encode()).digest() * 64).decode()
    return [
        {
            "type": "message",
            "id": f"u{turn}",
            "parentId": parent,
            "timestamp": "2026-11-23T10:00:00.000Z",
            "message": {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"turn {turn}"},
                    {"type": "image", "data": image, "mimeType": "image/png"},
                ],
            },
        },
        {
            "type": "message",
            "id": f"a{turn}",
            "parentId": f"u{turn}",
            "timestamp": "2026-11-23T10:00:01.000Z",
            "message": {"role": "assistant", "content": [{"type": "text", "text": "x" * 40_000}]},
        },
    ]


def _image_hash(turn: int) -> str:
    return hashlib.sha256(
        base64.b64decode(_entries(turn, None)[0]["message"]["content"][1]["data"])
    ).hexdigest()


def bucket_keys(settings: Settings, prefix: str) -> list[str]:
    """Every key under the bucket's ``prefix``, listed through the S3 HTTP API."""
    bucket = (settings.blob_url or "").removeprefix("s3://").split("/")[0]
    url = f"{os.environ['AWS_ENDPOINT_URL']}/{bucket}?list-type=2&prefix={prefix}"
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return re.findall(r"<Key>([^<]+)</Key>", body)


def _run_job(app: Any, name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Send a maintenance job by name until it claims a period (1 s windows here: another
    test in this process may hold the current one) and return its report."""
    for _ in range(10):
        result: dict[str, Any] = app.send_task(name, kwargs=kwargs).get(timeout=120)
        if result["ran"]:
            return dict(result["report"])
        time.sleep(1.1)
    raise AssertionError(f"{name} never claimed a period")


class Machine:
    def __init__(self, name: str, tmp: Path, shared: dict[str, str]) -> None:
        self.data = tmp / name / "data"
        home = tmp / name / "home"
        self.data.mkdir(parents=True)
        home.mkdir(parents=True)
        self.env = {**shared, "SESSIONSTORE_DATA_DIR": str(self.data), "HOME": str(home)}
        self.log = tmp / name / "worker.log"
        self.worker: WorkerProcess | None = None

    def start(self) -> None:
        self.worker = WorkerProcess(self.env, self.log)

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None

    def non_cache_files(self) -> list[str]:
        found = []
        for base, _dirs, files in os.walk(self.data):
            rel = Path(base).relative_to(self.data)
            if rel.parts[:1] == ("cache",):
                continue
            found += [str(rel / f) for f in files]
        return found


@pytest.fixture
def machines(
    pg_url: str, redis_url: str, s3_bucket: str, tmp_path: Path
) -> Iterator[tuple[Machine, Machine, Settings]]:
    env = settings_env(database_url=pg_url, broker_url=redis_url, data_dir=tmp_path / "unused")
    shared = {
        **env,
        "SESSIONSTORE_BLOB_URL": f"{s3_bucket}/blobs",
        "SESSIONSTORE_ARTIFACT_URL": f"{s3_bucket}/artifacts",
        "AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"],
        **{k: os.environ[k] for k in AWS},
        "SESSIONSTORE_GC_SCHEDULE": "1",
        "SESSIONSTORE_EXPIRE_SCHEDULE": "1",
    }
    client = Settings(
        data_dir=tmp_path / "client" / "data",
        database_url=pg_url,
        broker_url=redis_url,
        result_backend=redis_url,
        blob_url=f"{s3_bucket}/blobs",
        artifact_url=f"{s3_bucket}/artifacts",
    )
    a, b = Machine("a", tmp_path, shared), Machine("b", tmp_path, shared)
    try:
        yield a, b, client
    finally:
        a.stop()
        b.stop()


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.redis
def test_two_workers_share_everything_through_postgres_redis_and_s3(
    machines: tuple[Machine, Machine, Settings],
) -> None:
    a, b, client = machines
    app = create_app(client)
    with SessionStore.from_settings(client) as store:
        sid = store.create_session(tenant_id="acme", cwd="/work").id
        a.start()  # machine A writes
        parent = None
        for turn in range(3):
            enqueue_append(sid, _entries(turn, parent), app=app).get(timeout=120)
            parent = f"a{turn}"
        a.stop()
        assert store.get_session(sid).head_seq == 6
        oversized = store.store_oversized(sid, "big tool output " * 2_000, "bash")
        assert oversized is not None

        b.start()  # machine B rehydrates what A wrote; resolve works anywhere
        result = enqueue_rehydrate(sid, tenant_id="acme", format="events", app=app).get(timeout=120)
        b.stop()
        text = store.retrieve(result["ref"], session_id=sid)
        assert text is not None and len(text.encode()) == result["size"]
        assert result["missing_blobs"] == [] and base64.b64encode(PNG).decode()[:8] in text

        a.start()  # A copies the fork's artifacts, server-side
        attach_fork_copier(store, app)
        fork = store.fork(sid)
        assert fork.copy_status == "pending"  # handed to the queue, not copied here
        wait_for(lambda: store.get_session(fork.id).copy_status == "copied", 60, "fork copy")
        assert store.retrieve(oversized.ref.artifact_id, session_id=fork.id) is not None
        store.move(fork.id, tenant_id="globex")
        assert store.retrieve(oversized.ref.artifact_id, session_id=fork.id) is not None
        store.delete_session(sid)
        assert store.retrieve(oversized.ref.artifact_id, session_id=fork.id) is not None
        assert store.expire_artifacts(apply=True).errors == []

        # GC and expiry run on B: a blob only a deleted session used goes, those the fork
        # still reaches stay; an oversized output past its TTL goes, the others stay.
        doomed = store.create_session(tenant_id="acme").id
        enqueue_append(doomed, _entries(99, None), app=app).get(timeout=120)
        a.stop()
        store.delete_session(doomed)
        with SessionStore.from_settings(client.with_overrides(oversized_ttl_seconds=1)) as brief:
            stale = brief.store_oversized(fork.id, "stale tool output " * 2_000, "bash")
        assert stale is not None
        blobs_before = set(bucket_keys(client, "blobs/"))
        artifacts_before = set(bucket_keys(client, "artifacts/"))
        time.sleep(1.2)
        b.start()
        gc = _run_job(app, "sessionstore.gc_blobs", {"grace": 0})
        expiry = _run_job(app, "sessionstore.expire_artifacts", {})
        b.stop()
        gone = blobs_before - set(bucket_keys(client, "blobs/"))
        assert gc["deleted"] == 1 and gc["errors"] == []
        assert [_image_hash(99) in key for key in gone] == [True]
        assert expiry["deleted"] == 1 and expiry["errors"] == []
        assert [
            stale.ref.artifact_id in key
            for key in artifacts_before - set(bucket_keys(client, "artifacts/"))
        ] == [True]
        assert store.retrieve(stale.ref.artifact_id, session_id=fork.id) is None
        assert store.retrieve(oversized.ref.artifact_id, session_id=fork.id) is not None
        blobs_after = bucket_keys(client, "blobs/")
        assert all(any(_image_hash(t) in key for key in blobs_after) for t in range(3))

    assert "Task sessionstore.append[" in a.log.read_text()  # each step ran where it was sent
    assert "Task sessionstore.copy_artifacts[" in a.log.read_text()
    assert "Task sessionstore.rehydrate[" in b.log.read_text()
    assert "Task sessionstore.append[" not in b.log.read_text()
    for machine in (a, b):
        assert machine.non_cache_files() == [], machine.log.read_text()[-2000:]
