"""Health checks of the backends a deployment needs, each bounded by a timeout.

``sessionstore health`` runs these (plus the broker check, which belongs to the queue layer)
and compose uses it as the services' healthcheck. A check returns a short detail when the
backend works and raises when it does not; ``run_checks`` turns both, and a timeout, into
``CheckResult``s.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import make_url

from core import migrate
from core.blobs import blob_store_for
from core.blobs.files import FileBlobStore
from core.blobs.objects import ObjectBlobStore
from core.db import make_engine
from core.errors import DatabaseMissing, SchemaNotCurrent
from core.fsio import yet_to_make
from core.records import PlainRecord
from core.settings import Settings
from core.urls import hide_password

Check = Callable[[], str]


@dataclass(frozen=True, slots=True)
class CheckResult(PlainRecord):
    name: str
    ok: bool
    detail: str
    seconds: float


def run_checks(checks: Mapping[str, Check], *, timeout_s: float) -> list[CheckResult]:
    """Run every check at once; one that has not answered within ``timeout_s`` fails.

    Each check runs in a daemon thread: a check hung on an endpoint that never answers
    (obstore's own retries can take minutes) must not keep the process alive after the
    report, as a pool's worker threads would at interpreter exit."""
    started = time.monotonic()
    futures = {name: _start(name, check) for name, check in checks.items()}
    return [_outcome(name, future, started, timeout_s) for name, future in futures.items()]


def _start(name: str, check: Check) -> concurrent.futures.Future[str]:
    future: concurrent.futures.Future[str] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(check())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name=f"health-{name}", daemon=True).start()
    return future


def _outcome(
    name: str, future: concurrent.futures.Future[str], started: float, timeout_s: float
) -> CheckResult:
    remaining = max(0.0, timeout_s - (time.monotonic() - started))
    try:
        detail, ok = future.result(timeout=remaining), True
    except concurrent.futures.TimeoutError:
        detail, ok = f"no answer within {timeout_s:g} s", False
    except Exception as exc:
        detail, ok = " ".join(f"{type(exc).__name__}: {exc}".split()), False
    return CheckResult(name, ok, detail, round(time.monotonic() - started, 3))


def storage_checks(settings: Settings) -> dict[str, Check]:
    """The database (reachable, schema at head), the blob store and the artifact store."""
    return {
        "database": lambda: check_database(settings),
        "blobs": lambda: check_blobs(settings),
        "artifacts": lambda: check_artifact_storage(settings),
    }


def check_database(settings: Settings) -> str:
    url = settings.resolved_database_url
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        if not Path(parsed.database).exists():
            raise DatabaseMissing(parsed.database)  # a check never creates one
    current, head = migrate.current_revision(url), migrate.head_revision(url)
    if current != head:
        raise SchemaNotCurrent(f"schema at {current or 'none'}, code expects {head}")
    return f"schema at {current}"


def check_blobs(settings: Settings) -> str:
    # The probe reads no index: an engine of no database (the database is checked on its
    # own; a SQLite journal's engine makes the data dir, and a check makes nothing).
    engine = make_engine("sqlite://", pool_size=1)
    try:
        store = blob_store_for(settings, engine)
        if isinstance(store, ObjectBlobStore):
            store.probe()
            return f"object store {hide_password(settings.resolved_blob_url)} answers"
        assert isinstance(store, FileBlobStore)
        return check_artifacts(store.root, what="blob directory")
    finally:
        engine.dispose()


def check_artifact_storage(settings: Settings) -> str:
    """Write, read back and delete a probe on the artifact store (directory or bucket)."""
    from core.artifacts.storage import artifact_storage_for

    return artifact_storage_for(settings).probe()


def check_artifacts(root: Path, *, what: str = "artifact directory") -> str:
    """The directory takes a file; or it is not there yet and can be made (a check makes
    nothing: a mistyped data dir got the storage's folders)."""
    missing = yet_to_make(root, what)
    if missing is not None:
        return missing
    probe = root / f".health-{uuid.uuid4().hex}"
    probe.write_bytes(b"ok")
    probe.unlink()
    return f"{what} {root} is writable"
