"""``sessionstore.rehydrate`` through a real worker, Redis and PostgreSQL (and embedded).

The task's output is byte for byte what ``export`` writes; identical requests build once;
a killed build leaves nothing servable and its redelivery completes; expiry removes the
output; another tenant is refused as not found.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import select, update

from core import SessionStore, Settings
from core.artifacts.integrity import CHUNK_BYTES
from core.blobs.files import FileBlobStore
from core.errors import (
    InvalidEvent,
    RehydrateTooLong,
    ResolveNotFound,
    SessionNotFound,
    StorageUnavailable,
)
from core.interop import exporter
from core.interop.omp import export_omp
from core.interop.rehydrated import Request, rehydrate
from core.migrate import upgrade
from core.models import ArtifactRow, RehydrationRow, table_of, utcnow
from tasks import enqueue_rehydrate
from tasks.app import QUEUE, create_app
from tasks.embedded import embedded_worker
from tasks.rehydrate import REHYDRATE_TASK, RehydrateHandle
from tests.cli_process import run_cli
from tests.support import (
    WorkerProcess,
    clean_env,
    set_output_expiry,
    settings_env,
    thread_worker,
    wait_for,
)

PNG = b"\x89PNG\r\n\x1a\n"
_rows = table_of(RehydrationRow)
_artifacts = table_of(ArtifactRow)


def _session(store: SessionStore, turns: int = 6, *, tenant: str = "acme") -> str:
    sid = store.create_session(tenant_id=tenant, cwd="/work").id
    parent = None
    for i in range(turns):
        image = base64.b64encode(PNG + hashlib.sha256(f"{i % 3}".encode()).digest() * 64).decode()
        entries = [
            {
                "type": "message",
                "id": f"u{i}",
                "parentId": parent,
                "timestamp": "2026-11-23T10:00:00.000Z",
                "message": {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": f"turn {i}"},
                        {"type": "image", "data": image, "mimeType": "image/png"},
                    ],
                },
            },
            {
                "type": "message",
                "id": f"a{i}",
                "parentId": f"u{i}",
                "timestamp": "2026-11-23T10:00:01.000Z",
                "message": {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "x" * 20_000}],
                },
            },
        ]
        store.append(sid, entries)
        parent = f"a{i}"
    return sid


def _artifact_bytes(store: SessionStore, result: dict[str, Any], session_id: str) -> bytes:
    text = store.retrieve(result["ref"], session_id=session_id)
    assert text is not None
    return text.encode("utf-8", "surrogatepass")


def _exported(
    store: SessionStore, session_id: str, at_seq: int | None, fmt: str, tmp: Path | None = None
) -> bytes:
    out = io.StringIO()
    if fmt == "omp":  # the session file of `sessionstore export --format omp`
        assert tmp is not None
        done = export_omp(store, session_id, tmp / "omp", blobs_dir=tmp / "blobs", at_seq=at_seq)
        data = done.session_file.read_bytes()
        shutil.rmtree(tmp / "omp")
        return data
    if fmt == "pi":
        exporter.export_pi(store, session_id, out, at_seq=at_seq)
        return out.getvalue().encode("utf-8", "surrogatepass")
    result = rehydrate(store, Request(session_id, "acme", "events", at_seq))
    return _artifact_bytes(store, result, session_id)


@pytest.fixture
def store(queue_settings: Settings) -> Iterator[SessionStore]:
    with SessionStore.from_settings(queue_settings) as s:
        yield s


@pytest.fixture
def app(queue_settings: Settings) -> Celery:
    return create_app(queue_settings)


@pytest.mark.postgres
@pytest.mark.redis
def test_output_equals_export_at_head_and_earlier_for_each_format(
    store: SessionStore, app: Celery, tmp_path: Path
) -> None:
    sid = _session(store)
    with thread_worker(app, concurrency=2):
        for fmt in ("pi", "omp", "events"):
            for at_seq in (None, 5):
                result = enqueue_rehydrate(
                    sid, tenant_id="acme", at_seq=at_seq, format=fmt, app=app
                )
                got = result.get(timeout=60)
                data = _artifact_bytes(store, got, sid)
                assert (got["size"], got["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
                assert got["head_seq"] == (12 if at_seq is None else at_seq)
                assert got["missing_blobs"] == []
                if fmt in ("pi", "omp"):
                    assert data == _exported(store, sid, at_seq, fmt, tmp_path)
                    assert got["entries"] == got["head_seq"] + 1  # the header line too
                if fmt == "omp":  # images are refs, resolvable in this store
                    ref = data.split(b"blob:sha256:", 1)[1][:64].decode()
                    assert store.blobs.get(ref).startswith(PNG)
                if fmt == "events":
                    assert got["entries"] == got["head_seq"]
                    assert data.count(b"\n") == got["head_seq"] and PNG not in data
                    assert base64.b64encode(PNG).decode().encode()[:8] in data  # rehydrated
                # resolve accepts the reference, and pages through it
                page = store.resolve(got["ref"], session_id=sid, offset=1, limit=1)
                assert page.content.encode().rstrip(b"\n") == data.split(b"\n", 1)[0]


@pytest.mark.postgres
@pytest.mark.redis
def test_twenty_identical_requests_build_once(store: SessionStore, app: Celery) -> None:
    sid = _session(store, turns=4)
    with thread_worker(app, concurrency=4):
        handles = [enqueue_rehydrate(sid, tenant_id="acme", app=app) for _ in range(20)]
        results = [h.get(timeout=120) for h in handles]
    assert len({r["ref"] for r in results}) == 1
    assert sum(1 for r in results if not r["reused"]) == 1
    with store.engine.connect() as conn:
        builds = conn.execute(select(_rows.c.builds).where(_rows.c.session_id == sid)).all()
    assert [b for (b,) in builds] == [1]


@pytest.mark.postgres
def test_a_build_that_finished_after_the_waiter_looked_is_not_claimed_again(
    store: SessionStore,
) -> None:
    """A waiter looks (``_usable``: still building), the build finishes, the waiter then
    tries to claim: it must not take a finished build whose output lives (it did: the
    claim took any DONE row, and one of twenty identical requests in CI built twice)."""
    from core.interop.rehydrated import _claim

    sid = _session(store, turns=1)
    first = rehydrate(store, Request(sid, "acme"))
    key = (sid, "pi", first["head_seq"])
    assert not _claim(store, key, "waiter")  # done, output live: serve it
    with store.engine.begin() as conn:  # long done: its heartbeat is old, its output lives
        conn.execute(
            update(_rows)
            .where(_rows.c.session_id == sid)
            .values(heartbeat_at=utcnow() - timedelta(hours=1))
        )
    assert not _claim(store, key, "waiter")
    assert rehydrate(store, Request(sid, "acme"))["reused"]
    set_output_expiry(store, first["ref"], timedelta(seconds=-1))
    assert _claim(store, key, "waiter")
    assert not _claim(store, key, "another")  # a live build (fresh heartbeat) is not taken
    with store.engine.begin() as conn:  # its builder died: taken over
        conn.execute(
            update(_rows)
            .where(_rows.c.session_id == sid)
            .values(heartbeat_at=utcnow() - timedelta(minutes=1))
        )
    assert _claim(store, key, "another")


@pytest.mark.postgres
@pytest.mark.redis
def test_another_tenant_is_refused_as_not_found(store: SessionStore, app: Celery) -> None:
    sid = _session(store, turns=1)
    with thread_worker(app, concurrency=1):
        with pytest.raises(SessionNotFound):
            enqueue_rehydrate(sid, tenant_id="other", app=app).get(timeout=30)
    with store.engine.connect() as conn:
        assert conn.execute(select(_rows)).all() == []


@pytest.mark.postgres
@pytest.mark.redis
def test_expiry_removes_the_output_and_resolve_then_says_not_found(
    store: SessionStore, app: Celery
) -> None:
    sid = _session(store, turns=1)
    with thread_worker(app, concurrency=1):
        first = enqueue_rehydrate(sid, tenant_id="acme", app=app).get(timeout=60)
    set_output_expiry(store, first["ref"], timedelta(seconds=-1))
    report = store.expire_artifacts(apply=True)
    assert report.deleted == 1
    with pytest.raises(ResolveNotFound):
        store.resolve(first["ref"], session_id=sid)
    with thread_worker(app, concurrency=1):  # a new request builds anew
        again = enqueue_rehydrate(sid, tenant_id="acme", app=app).get(timeout=60)
    assert again["ref"] != first["ref"] and not again["reused"]


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
def test_a_worker_killed_mid_build_serves_nothing_partial_and_the_retry_completes(
    store: SessionStore, queue_settings: Settings, redis_url: str, tmp_path: Path
) -> None:
    sid = _session(store, turns=60)
    env = settings_env(
        database_url=queue_settings.resolved_database_url,
        broker_url=redis_url,
        data_dir=queue_settings.data_dir,
        visibility_timeout=10,
    )
    app = create_app(queue_settings.with_overrides(task_visibility_timeout=10))
    # 120 events, ~2.5 s: time to kill it. Slow only while `slow_flag` exists: the retry
    # must finish inside the soft time limit (4 s at this visibility timeout), under load too.
    slow_flag = tmp_path / "slow"
    slow_flag.touch()
    slow = {**env, "SS_SLOW_REHYDRATE_S": "0.02", "SS_SLOW_REHYDRATE_WHILE": str(slow_flag)}
    worker = WorkerProcess(slow, tmp_path / "w1.log", concurrency=1, include="tests.faults")
    try:
        handle = enqueue_rehydrate(sid, tenant_id="acme", app=app)
        wait_for(lambda: handle.progress() is not None, 60, "the build to report progress")
        [child] = _pool_children(worker.proc.pid)
        os.kill(child, signal.SIGKILL)  # the pool process dies mid-build
        slow_flag.unlink()
        with store.engine.connect() as conn:
            assert conn.execute(select(_rows.c.status)).scalars().all() == ["building"]
            published = select(_artifacts).where(_artifacts.c.session_id == sid)
            assert conn.execute(published).all() == []  # nothing partial to serve
        # Rejected on worker loss and redelivered; the new run waits out the dead build's
        # heartbeat, takes the build over and completes it.
        result = handle.get(timeout=120)
    finally:
        worker.stop()
    data = _artifact_bytes(store, result, sid)
    assert data == _exported(store, sid, None, "pi")


def _pool_children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_embedded_mode_builds_with_a_real_worker(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "embedded")
    upgrade(settings.resolved_database_url)
    app = create_app(settings)
    with SessionStore.from_settings(settings) as store, embedded_worker(app):
        sid = _session(store, turns=2)
        got = enqueue_rehydrate(sid, tenant_id="acme", app=app).get(timeout=60)
        assert _artifact_bytes(store, got, sid) == _exported(store, sid, None, "pi")


def test_bad_requests_are_refused_at_the_door(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path / "d"))
    from core.errors import InvalidEvent

    with pytest.raises(InvalidEvent, match="format"):
        enqueue_rehydrate("s", tenant_id="t", format="zip", app=app)
    with pytest.raises(InvalidEvent, match="at_seq"):
        enqueue_rehydrate("s", tenant_id="t", at_seq=-1, app=app)


@pytest.mark.postgres
@pytest.mark.redis
def test_cli_export_via_queue_equals_export(
    store: SessionStore, queue_settings: Settings, redis_url: str, tmp_path: Path
) -> None:
    """Through a real ``celery worker``: an export of several streamed read chunks, to a
    file and to stdout, is byte for byte what the direct export writes."""
    sid = _large_session(store, chunks=3)
    env = {
        **os.environ,
        **settings_env(
            database_url=queue_settings.resolved_database_url,
            broker_url=redis_url,
            data_dir=queue_settings.data_dir,
        ),
    }
    worker = WorkerProcess(env, tmp_path / "w.log", concurrency=1)
    try:
        to_file = run_cli("export", sid, "--via-queue", "-o", str(tmp_path / "q.jsonl"), env=env)
        assert to_file.returncode == 0, to_file.stderr
        to_stdout = run_cli("export", sid, "--via-queue", env=env)
        assert to_stdout.returncode == 0, to_stdout.stderr
    finally:
        worker.stop()
    direct = run_cli("export", sid, "-o", str(tmp_path / "d.jsonl"), env=env)
    assert direct.returncode == 0, direct.stderr
    expected = (tmp_path / "d.jsonl").read_bytes()
    assert len(expected) > 3 * CHUNK_BYTES
    assert (tmp_path / "q.jsonl").read_bytes() == expected
    assert to_stdout.stdout.encode() == expected


def _large_session(store: SessionStore, chunks: int) -> str:
    """A session whose pi export is over ``chunks`` chunks of the CLI's streamed read."""
    sid = store.create_session(tenant_id="acme", cwd="/work").id
    text = "".join(f"line {i} of a long tool output\n" for i in range(CHUNK_BYTES // 30))
    entries = [
        {
            "type": "message",
            "id": f"m{i}",
            "parentId": f"m{i - 1}" if i else None,
            "timestamp": "2026-11-23T10:00:00.000Z",
            "message": {"role": "user", "content": [{"type": "text", "text": f"{i}{text}"}]},
        }
        for i in range(chunks)
    ]
    store.append(sid, entries)
    return sid


def _embedded_cli(tmp_path: Path, *, turns: int) -> tuple[str, dict[str, str]]:
    """(a session of ``turns`` turns on embedded defaults, the CLI's environment for them):
    no SESSIONSTORE_ variable of the caller's leaks in."""
    settings = Settings(data_dir=tmp_path / "embedded")
    upgrade(settings.resolved_database_url)
    with SessionStore.from_settings(settings) as store:
        sid = _session(store, turns=turns)
    return sid, clean_env(settings.data_dir)


def test_cli_export_via_queue_on_embedded_defaults_needs_no_worker(tmp_path: Path) -> None:
    """With the embedded broker nothing else consumes the queue: the command runs a worker
    of its own, as ``append`` does (it waited for one that never came)."""
    sid, env = _embedded_cli(tmp_path, turns=2)
    for name, extra in (("q.jsonl", ["--via-queue", "--timeout", "60"]), ("d.jsonl", [])):
        done = run_cli("export", sid, "-o", str(tmp_path / name), *extra, env=env)
        assert done.returncode == 0, done.stderr
    assert (tmp_path / "q.jsonl").read_bytes() == (tmp_path / "d.jsonl").read_bytes()
    # to stdout, --json or not, stdout holds the export alone (the queue's summary was
    # printed after it: no JSON and no JSONL reader could take it)
    for extra in ([], ["--json"]):
        done = run_cli("export", sid, "--via-queue", "--timeout", "60", *extra, env=env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.encode() == (tmp_path / "d.jsonl").read_bytes(), extra
    for extra in (["--via-queue"], []):  # a usage error on both paths (it was 3 via the queue)
        done = run_cli("export", sid, "--format", "bogus", *extra, env=env)
        assert done.returncode == 2 and "unknown export format 'bogus'" in done.stderr, extra


def test_an_export_missing_a_blob_says_so_and_exits_1_on_every_path(tmp_path: Path) -> None:
    """A blob lost (or corrupt, refused) under a session: pi's file, oh-my-pi's layout and
    the queue's export are each written whole, with the ref where the value was, and exit
    1 naming the blob (--json: missing_blobs). They exited 0, reporting a complete file."""
    sid, env = _embedded_cli(tmp_path, turns=1)
    with SessionStore.from_settings(Settings(data_dir=tmp_path / "embedded")) as store:
        text_hash = next(
            m.hash for m in store.journal.manifest_of(store.read(sid))[2] if m.size == 20_000
        )
        blobs = store.blobs
        assert isinstance(blobs, FileBlobStore)
        blobs.path_for(text_hash, blobs.info(text_hash).codec).unlink()  # type: ignore[union-attr]
    outputs = {
        "pi": ["-o", str(tmp_path / "d.jsonl")],
        "queue": ["-o", str(tmp_path / "q.jsonl"), "--via-queue", "--timeout", "60"],
        "omp": ["--format", "omp", "-o", str(tmp_path / "omp")],
    }
    for name, extra in outputs.items():
        done = run_cli("export", sid, *extra, "--json", env=env)
        assert done.returncode == 1, (name, done.returncode, done.stderr)
        assert f"1 blob(s) could not be read (missing or corrupt): {text_hash[:12]}" in done.stderr
        assert json.loads(done.stdout)["missing_blobs"] == [text_hash], name
    written = (tmp_path / "d.jsonl").read_text()
    assert f"blob:sha256:{text_hash}" in written and written == (tmp_path / "q.jsonl").read_text()
    streamed = run_cli("export", sid, env=env)
    assert streamed.returncode == 1 and streamed.stdout == written


def test_a_failed_export_leaves_no_file_behind(tmp_path: Path) -> None:
    """Not found, or an output that is a directory: nothing half-written is left (the
    directory case left a whole ``.partial`` beside it)."""
    sid, env = _embedded_cli(tmp_path, turns=1)
    out = tmp_path / "out"
    out.mkdir()
    assert run_cli("export", sid, "-o", str(out), env=env).returncode == 2
    assert run_cli("export", "no-such", "-o", str(tmp_path / "x.jsonl"), env=env).returncode == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["embedded", "out"]
    assert run_cli("export", sid, "-o", str(tmp_path / "x.jsonl"), env=env).returncode == 0
    assert oct((tmp_path / "x.jsonl").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.redis
def test_cli_export_via_queue_fails_typed_when_its_wait_runs_out(
    redis_url: str, tmp_path: Path
) -> None:
    """No result within --timeout (here no worker consumes the Redis queue; a build hung on
    a stalled read looks the same from the CLI): one line and exit 1, where it waited
    forever."""
    sid, env = _embedded_cli(tmp_path, turns=1)
    env["SESSIONSTORE_BROKER_URL"] = redis_url
    argv = ["export", sid, "--via-queue", "-o", str(tmp_path / "q")]
    # --timeout, then its default: twice the build bound
    bounded = {**env, "SESSIONSTORE_REHYDRATE_STALL_SECONDS": "0.25"}
    for extra, run_env in ((["--timeout", "0.5"], env), ([], bounded)):
        done = run_cli(*argv, *extra, env=run_env, timeout=30)
        assert done.returncode == 1, (done.returncode, done.stderr)
        line = done.stderr.strip().splitlines()[-1]  # after the progress bar's blank line
        assert line.startswith(f"error: export of {sid} via the queue not finished after 0.5s")
    assert not (tmp_path / "q").exists()


@pytest.mark.redis
@pytest.mark.parametrize("fmt", ["pi", "omp"])
def test_cli_export_via_queue_to_a_directory_is_refused_before_any_work(
    redis_url: str, tmp_path: Path, fmt: str
) -> None:
    """A worker builds one file, omp's too: ``-o DIR`` (omp's own layout without the queue)
    is a usage error up front, where the worker built the export and the CLI then failed
    writing it (``Is a directory``, exit 3)."""
    sid, env = _embedded_cli(tmp_path, turns=1)
    env["SESSIONSTORE_BROKER_URL"] = redis_url  # no worker: a request would wait
    out = tmp_path / "out"
    out.mkdir()
    argv = ["export", sid, "--format", fmt, "--via-queue", "-o", str(out), "--timeout", "5"]
    done = run_cli(*argv, env=env, timeout=30)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "is a directory: with --via-queue the export is one file" in done.stderr
    assert list(out.iterdir()) == []


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
def test_a_500_mb_session_builds_in_bounded_worker_memory(
    store: SessionStore, queue_settings: Settings, redis_url: str, tmp_path: Path
) -> None:
    """Screenshots and tool outputs worth 500 MB once rehydrated; the pool process that
    builds the export peaks under 250 MB (VmHWM from /proc)."""
    image = PNG + os.urandom(4 * 1024 * 1024)  # one 4 MiB screenshot, shown again and again
    data = base64.b64encode(image).decode()
    log_text = "".join(f"line {i:07d} of a long tool output\n" for i in range(60_000))
    sid = store.create_session(tenant_id="acme").id
    total = 0
    for i in range(120):
        block: dict[str, Any] = (
            {"type": "image", "data": data, "mimeType": "image/png"}
            if i % 3
            else {"type": "text", "text": log_text}
        )
        store.append(
            sid,
            [
                {
                    "type": "message",
                    "id": f"m{i}",
                    "parentId": None,
                    "message": {"role": "user", "content": [block]},
                }
            ],
        )
        total += len(data) if i % 3 else len(log_text)
    assert total > 500 * 10**6
    env = settings_env(
        database_url=queue_settings.resolved_database_url,
        broker_url=redis_url,
        data_dir=queue_settings.data_dir,
    )
    app = create_app(queue_settings)
    worker = WorkerProcess(env, tmp_path / "w.log", concurrency=1)
    try:
        # the same one child in three reads in a row: a process the worker runs for a moment
        # while it starts can be its only child at one read and gone at the next (seen in CI)
        seen: list[tuple[int, ...]] = []

        def one_pool_process() -> bool:
            seen.append(tuple(_pool_children(worker.proc.pid)))
            return len(seen[-1]) == 1 and seen[-3:] == [seen[-1]] * 3

        wait_for(one_pool_process, 60, "the pool process", step=0.2)
        [child] = seen[-1]
        result = enqueue_rehydrate(sid, tenant_id="acme", format="events", app=app).get(timeout=600)
        status = Path(f"/proc/{child}/status").read_text()
        peak_kb = int(
            next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1]
        )
    finally:
        worker.stop()
    assert result["size"] > 500 * 10**6 and result["missing_blobs"] == []
    print(f"\n500 MB build: {result['size'] / 1e6:.0f} MB, worker peak RSS {peak_kb / 1024:.0f} MB")
    assert peak_kb < 250 * 1024


@contextmanager
def _faulty_worker(
    settings: Settings, tmp_path: Path, *faults: str, **env: str
) -> Iterator[tuple[Celery, Path]]:
    """A prefork worker (one process, visibility timeout 10 s: soft/hard limits 4/5 s) with
    ``tests.faults``' rehydrate faults armed; yields an app on the same settings and the
    fault directory (a fault that fired is renamed ``NAME.used``)."""
    armed = tmp_path / "faults"
    armed.mkdir()
    for fault in faults:
        (armed / fault).touch()
    worker_env = settings_env(
        database_url=settings.resolved_database_url,
        broker_url=str(settings.broker_url),
        data_dir=settings.data_dir,
        visibility_timeout=10,
    )
    worker = WorkerProcess(
        {**worker_env, "SS_TASK_FAULTS": str(armed), **env},
        tmp_path / "w.log",
        concurrency=1,
        include="tests.faults",
    )
    try:
        yield create_app(settings.with_overrides(task_visibility_timeout=10)), armed
    finally:
        worker.stop()


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.parametrize(
    "faults",
    [
        # A transient failure retries; when the broker refused that retry's publish, Celery
        # rejected the message without requeueing it: the request ended FAILED, gone.
        ("transient", "refuse_publish"),
        # A build killed at the hard time limit is stored as a FAILURE while its message
        # goes back to the queue and runs again: ``get`` raised that failure, and the
        # export the requeued run then built was never seen.
        pytest.param(("stuck",), marks=pytest.mark.slow),
    ],
    ids=["retry-not-published", "killed-at-hard-limit"],
)
def test_a_request_survives_its_worker_failures_and_get_returns_its_export(
    store: SessionStore, queue_settings: Settings, tmp_path: Path, faults: tuple[str, ...]
) -> None:
    sid = _session(store, turns=2)
    with _faulty_worker(queue_settings, tmp_path, *faults) as (app, armed):
        result = enqueue_rehydrate(sid, tenant_id="acme", app=app).get(timeout=90)
    assert all((armed / f"{fault}.used").exists() for fault in faults)  # each fired
    assert _artifact_bytes(store, result, sid) == _exported(store, sid, None, "pi")


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
def test_a_build_cut_at_the_soft_limit_is_refused_typed_and_releases_its_claim(
    store: SessionStore, queue_settings: Settings, tmp_path: Path
) -> None:
    """120 events at 0.1 s each outlast the 4 s soft limit: the task failed with a bare
    ``SoftTimeLimitExceeded``; it is refused as ``RehydrateTooLong`` (built again, it would
    be cut again), and no claim is left to block the next request."""
    sid = _session(store, turns=60)
    with _faulty_worker(queue_settings, tmp_path, SS_SLOW_REHYDRATE_S="0.1") as (app, _):
        with pytest.raises(RehydrateTooLong, match="soft time limit"):
            enqueue_rehydrate(sid, tenant_id="acme", app=app).get(timeout=60)
    # the claim given up: built here at once, not RehydrateInProgress after a wait
    result = rehydrate(store, Request(sid, "acme"), wait_s=0)
    assert _artifact_bytes(store, result, sid) == _exported(store, sid, None, "pi")


@pytest.mark.postgres
@pytest.mark.redis
def test_a_request_without_a_tenant_or_with_a_bad_id_is_refused_typed(
    store: SessionStore, app: Celery
) -> None:
    """``tenant_id=None`` reached ``get_session(tenant_id=None)``, which finds a session in
    any tenant: another tenant's content was exported. A bad id was published and failed in
    the worker with a bare TypeError. Both are refused at the door, and by the task too
    (a client that sends the message itself)."""
    sid = _session(store, turns=1)
    for kwargs, field in (
        ({"session_id": sid, "tenant_id": None}, "tenant_id"),
        ({"session_id": sid, "tenant_id": ""}, "tenant_id"),
        ({"session_id": 123, "tenant_id": "acme"}, "session_id"),
        ({"session_id": "a\x00b", "tenant_id": "acme"}, "session_id"),
    ):
        with pytest.raises(InvalidEvent) as refused:
            enqueue_rehydrate(kwargs.pop("session_id"), app=app, **kwargs)  # type: ignore[arg-type]
        assert refused.value.field == field
    with thread_worker(app, concurrency=1):
        for kwargs, field in (
            ({"session_id": sid, "tenant_id": None}, "tenant_id"),
            ({"session_id": 123, "tenant_id": "acme"}, "session_id"),
        ):
            sent = app.send_task(REHYDRATE_TASK, kwargs=kwargs, queue=QUEUE)
            with pytest.raises(InvalidEvent) as refused:
                RehydrateHandle(app, sent.id).get(timeout=30)
            assert refused.value.field == field


def test_an_unreachable_broker_is_storage_unavailable_on_every_producer_call(
    tmp_path: Path,
) -> None:
    """The publish raised kombu's OperationalError, and ``get``/``progress`` redis'
    ConnectionError, where ``enqueue_append`` says ``StorageUnavailable``."""
    away = "redis://127.0.0.1:1/0"
    app = create_app(
        Settings(
            data_dir=tmp_path / "d", broker_url=away, result_backend=away, publish_retry_seconds=0
        )
    )
    calls = (
        lambda: enqueue_rehydrate("s", tenant_id="t", app=app),
        lambda: RehydrateHandle(app, "some-id").get(timeout=1),
        lambda: RehydrateHandle(app, "some-id").progress(),
    )
    for call in calls:
        with pytest.raises(StorageUnavailable) as away_error:
            call()
        assert away_error.value.component == "broker"


@pytest.mark.postgres
@pytest.mark.redis
def test_a_progress_report_that_cannot_be_stored_ends_no_build(
    store: SessionStore, app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Progress is a report: the result backend refusing it (a blip) raised out of the
    build, which started over on each retry and, refused every time, never finished."""
    sid = _session(store, turns=30)  # 60 events: a report mid-build (every 50), not only at the end
    reports: list[object] = []

    def refused(*args: object, **kwargs: object) -> None:
        reports.append(kwargs.get("meta"))
        raise ConnectionError("injected: the result backend is away")

    monkeypatch.setattr(app.tasks[REHYDRATE_TASK], "update_state", refused)
    with thread_worker(app, concurrency=1):
        result = enqueue_rehydrate(sid, tenant_id="acme", app=app).get(timeout=60)
    assert reports, "the build reported no progress: the test tests nothing"
    assert _artifact_bytes(store, result, sid) == _exported(store, sid, None, "pi")


@pytest.mark.postgres
@pytest.mark.redis
def test_a_request_that_fails_for_good_raises_its_typed_error(
    store: SessionStore, queue_settings: Settings, tmp_path: Path
) -> None:
    """Storage away past the retries: ``get`` raised a bare SessionStoreError wrapping its
    repr, the type a caller acts on (retry later: StorageUnavailable) lost."""
    sid = _session(store, turns=1)
    retries = {"SESSIONSTORE_TASK_MAX_RETRIES": "0"}
    with _faulty_worker(queue_settings, tmp_path, "transient", **retries) as (app, armed):
        with pytest.raises(StorageUnavailable, match="injected") as away:
            enqueue_rehydrate(sid, tenant_id="acme", app=app).get(timeout=60)
    assert (armed / "transient.used").exists() and away.value.component == "database"


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.parametrize("to_file", [False, True], ids=["stdout", "file"])
def test_cli_export_writes_each_chunk_as_it_reads_it_and_never_reads_it_whole(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, to_file: bool
) -> None:
    """Memory bounded by a chunk: the output a worker built is read by ``retrieve_chunks``
    and each chunk is written out before the next one is read; the all-bytes ``retrieve``
    is never called. (The build runs here: it is the CLI's read that is under test.)"""
    from tasks.cli import interop

    sid = _large_session(store, chunks=1)
    result = rehydrate(store, Request(sid, "acme", "pi"))

    def whole(*args: object, **kwargs: object) -> None:
        raise AssertionError("the export was read whole")

    monkeypatch.setattr(store, "retrieve", whole)
    monkeypatch.setattr(store.oversized, "retrieve", whole)
    output = tmp_path / "out.jsonl" if to_file else None
    chunk_bytes = 64 * 1024  # more than a file's write buffer: each write reaches the disk
    sent: list[int] = []

    class Stdout(io.BytesIO):
        def write(self, data: Any) -> int:
            sent.append(len(data))
            return super().write(data)

    def out_so_far() -> int:
        if output is None:
            return sum(sent)
        assert not output.exists()  # published only once whole
        (partial,) = tmp_path.glob(".out.jsonl.*.partial")
        return partial.stat().st_size

    real = store.oversized.retrieve_chunks
    pulled = [0]

    def spy(ref: str, *, session_id: str, tenant_id: str | None = None) -> Iterator[bytes]:
        found = real(ref, session_id=session_id, tenant_id=tenant_id, chunk_bytes=chunk_bytes)
        assert found is not None
        for chunk in found:
            if pulled[0]:  # every chunk read so far is out before the next is read
                assert out_so_far() == pulled[0] * chunk_bytes
            pulled[0] += 1
            yield chunk

    monkeypatch.setattr(store, "retrieve_chunks", spy)
    stdout = Stdout()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(stdout))
    interop._write_export(store, result["ref"], sid, output)
    data = output.read_bytes() if output is not None else stdout.getvalue()
    assert data == _exported(store, sid, None, "pi")
    assert pulled[0] == -(-len(data) // chunk_bytes) > 10


def test_a_corrupt_export_via_queue_leaves_no_file_and_exits_1(tmp_path: Path) -> None:
    """The stored output overwritten in place after its build: the export reusing it fails
    (exit 1) once its last chunk is checked, and leaves no file at ``-o`` (on stdout, what
    was written is followed by the failure). It wrote the bytes as the export, exit 0."""
    sid, env = _embedded_cli(tmp_path, turns=2)
    argv = ["export", sid, "--via-queue", "--timeout", "60"]
    built = run_cli(*argv, "-o", str(tmp_path / "q.jsonl"), env=env)
    assert built.returncode == 0, built.stderr
    root = Settings(data_dir=tmp_path / "embedded").resolved_artifact_root
    (stored,) = root.rglob("oversized/art_*.txt")
    with open(stored, "r+b") as out:
        out.write(b"EVIL")  # the same size: only the digest tells
    refused = run_cli(*argv, "-o", str(tmp_path / "r.jsonl"), env=env)
    assert refused.returncode == 1, refused.stderr
    assert "is corrupt" in refused.stderr.splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["embedded", "q.jsonl"]
